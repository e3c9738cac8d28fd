"""Layer-wise probing: which layer (or mix of layers) carries what a task needs, as tables and plots.

See :func:`run` (``layerwise probe`` on the command line).
"""

from .config import ProbeConfig
from .metrics import detect_scheme, tagging_scores
from .models import CRF, PROBES, ProbeSpec, SequenceProbe, probe_specs
from .report import cka_matrix, linear_cka
from .run import ProbeResults, run

__all__ = ["CRF", "PROBES", "ProbeConfig", "ProbeResults", "ProbeSpec", "SequenceProbe", "cka_matrix",
           "detect_scheme", "linear_cka", "probe_specs", "run", "tagging_scores"]
