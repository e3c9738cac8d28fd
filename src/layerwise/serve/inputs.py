"""What a request's input may be, said once for the OpenAPI document and for the checks, so that the schema says what
the service enforces.

=====================  ====================================================  =====================================
input                  rule                                                  schema
=====================  ====================================================  =====================================
a text                 not blank (something left after stripping            ``pattern``
                       whitespace: :func:`~layerwise.corpus.records.is_blank`,
                       the rule of ``layerwise extract``)
a list of inputs       at least one                                          ``minItems: 1``
a word list            at least one word, each word not blank                ``minItems: 1``, ``pattern``
token ids              at least one, each in ``0..vocab-1`` of the model     ``minimum``/``maximum`` (filled per
                                                                             model by :func:`fill_model_facts`)
TEI ``prompt_name``    a prompt of the model's sentence-transformers config  ``enum`` of them (per model), else null
=====================  ====================================================  =====================================

The sizes a server is configured with (``max_texts``, ``max_text_chars``, the answer's bytes, the tokens of a request)
are said by its messages, not its schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BeforeValidator, Field, StrictInt, StrictStr

from ..corpus.records import NON_BLANK, is_blank

TOKEN_ID = "x-layerwise-token-id"  # marks a token id's schema; fill_model_facts sets its range
PROMPT_NAME = "x-layerwise-prompt-name"  # marks TEI's prompt_name; fill_model_facts sets its values



def _whole(value: Any) -> Any:
    """A float with no fractional part as the int it is (JSON has one number type: ``1.0`` is the integer 1, as JSON
    Schema's ``integer`` says); anything else as it is, for the strict check (``true`` is not 1, ``"3"`` not 3)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


WholeInt = Annotated[StrictInt, BeforeValidator(_whole)]  # an integer, written 3 or 3.0, never true or "3"
Text = Annotated[StrictStr, Field(json_schema_extra={"pattern": NON_BLANK})]
Texts = Annotated[list[Text], Field(json_schema_extra={"minItems": 1})]
Word = Annotated[StrictStr, Field(json_schema_extra={"pattern": NON_BLANK})]
WordList = Annotated[list[Word], Field(json_schema_extra={"minItems": 1})]
Words = Annotated[list[WordList], Field(json_schema_extra={"minItems": 1})]
TokenId = Annotated[WholeInt, Field(json_schema_extra={TOKEN_ID: True, "minimum": 0})]
TokenIds = Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]
# OpenAI's input and TEI's inputs: a text, texts, one list of token ids, or lists of them
Inputs = Union[Text, Texts, TokenIds, Annotated[list[TokenIds], Field(json_schema_extra={"minItems": 1})]]


def blank_message(index: int, what: str = "text") -> str:
    """The message for blank input ``index`` (``what``: ``text``, or the words of a word list)."""
    return f"{what} {index} is empty (nothing left after stripping whitespace); send text, or leave it out"


def fill_model_facts(doc: dict[str, Any], vocab: int, prompts: list[str]) -> dict[str, Any]:
    """``doc`` (an OpenAPI document) with the served model's facts: every token id's ``maximum`` (``vocab - 1``) and
    TEI's ``prompt_name`` values (the model's prompt names, or null only when it has none)."""

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop(TOKEN_ID, False):
                node["maximum"] = vocab - 1
            if node.pop(PROMPT_NAME, False):
                node.clear()
                node.update({"anyOf": [{"type": "string", "enum": prompts}, {"type": "null"}]} if prompts
                            else {"type": "null"})
                node["description"] = "A prompt of the model's config_sentence_transformers.json."
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return doc


__all__ = ["Inputs", "NON_BLANK", "PROMPT_NAME", "TOKEN_ID", "Text", "Texts", "TokenIds", "WholeInt", "WordList",
           "Words", "blank_message", "fill_model_facts", "is_blank"]
