"""Deprecated path of :mod:`jflashloop.apps.loops` (removed in the next release).

``python -m jflashloop.loops_report`` still runs; ``jflashloop loops`` and
``python -m jflashloop.apps.loops`` are the supported forms. The float64
measures are in :mod:`jflashloop.apps.float64_metrics`.
"""

import sys

from ._deprecation import warn_moved
from .apps.float64_metrics import causal_attention_float64 as causal_attention_float64
from .apps.float64_metrics import kl_divergence as kl_divergence
from .apps.float64_metrics import log_softmax as log_softmax
from .apps.float64_metrics import next_token_agreement as next_token_agreement
from .apps.float64_metrics import relative_error as relative_error
from .apps.loops.cli import main as main
from .apps.loops.cli import parse_arguments as parse_arguments
from .apps.loops.metrics import attention_errors as attention_errors
from .apps.loops.metrics import bits_per_byte as bits_per_byte
from .apps.loops.metrics import chain_errors as chain_errors
from .apps.loops.metrics import leading_agreement as leading_agreement
from .apps.loops.metrics import logit_metrics as logit_metrics
from .apps.loops.metrics import packed_positions as packed_positions
from .apps.loops.metrics import sparse_row_positions as sparse_row_positions
from .apps.loops.metrics import storage_summary as storage_summary
from .apps.loops.metrics import successive_loop_cosine as successive_loop_cosine
from .apps.loops.report import PAGE_SIZE_REASON as PAGE_SIZE_REASON
from .apps.loops.report import describe_inputs as describe_inputs
from .apps.loops.report import describe_sparse_rule as describe_sparse_rule
from .apps.loops.report import format_report as format_report
from .apps.loops.runner import DEFAULT_CHECKPOINT as DEFAULT_CHECKPOINT
from .apps.loops.runner import PAGE_SIZE as PAGE_SIZE
from .apps.loops.runner import ReportSettings as ReportSettings
from .apps.loops.runner import bfloat16_dense_attention as bfloat16_dense_attention
from .apps.loops.runner import bfloat16_loop_caches as bfloat16_loop_caches
from .apps.loops.runner import bfloat16_round_trip as bfloat16_round_trip
from .apps.loops.runner import compare_caches as compare_caches
from .apps.loops.runner import cross_loop_cache_config as cross_loop_cache_config
from .apps.loops.runner import decode_tokens as decode_tokens
from .apps.loops.runner import greedy_tokens as greedy_tokens
from .apps.loops.runner import held_out_windows as held_out_windows
from .apps.loops.runner import model_queries as model_queries
from .apps.loops.runner import packed_pages_per_sequence as packed_pages_per_sequence
from .apps.loops.runner import prefill_cross_loop_cache as prefill_cross_loop_cache
from .apps.loops.runner import prefilled_cache_errors as prefilled_cache_errors
from .apps.loops.runner import reconstruct_every_loop as reconstruct_every_loop
from .apps.loops.runner import run_report as run_report

warn_moved(__name__, "jflashloop.apps.loops")

if __name__ == "__main__":
    warn_moved("python -m jflashloop.loops_report", "jflashloop loops", stacklevel=2)
    sys.exit(main())
