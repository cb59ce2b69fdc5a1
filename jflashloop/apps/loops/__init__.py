"""A looped model end to end on the cross-loop 4-bit cache, against four BF16 caches.

The report runs the tiny byte-level Ouro-style model (:mod:`jflashloop.models.ouro`,
checkpoint ``jflashloop/models/data/ouro_tiny.npz`` by default) on held-out
bytes of the Python standard library (the split of
:mod:`jflashloop.models.stdlib_text` that ``bench/train_ouro.py`` trains on)
and measures:

1. how similar the K and V of successive loops are (cosine per layer);
2. KV bytes per token of four BF16 loop caches and of the cross-loop cache
   (:mod:`jflashloop.storage`);
3. the attention-output relative error of each loop, for the model's own
   queries, over the K/V the prefilled cache reconstructs;
4. logit KL divergence and next-token agreement between the two caches when
   the same tokens go through :func:`~jflashloop.models.ouro.decode_step`,
   teacher forced on held-out text, then on a greedy continuation;
5. held-out bits per byte through both caches;
6. what closed-loop residual encoding saves against open loop.

The cross-loop cache is :meth:`CacheConfig.flashloop`: loop 1 an INT4 base,
loop 2 a dense INT4 residual, loops 3 and 4 sparse INT4 residuals for 25 % and
10 % of each page's rows (rounded up). Pages hold 64 tokens: 64 is FlashLoop's
K group (per channel over 64 tokens), so every K group fills exactly one page
at 4.5 bits per element; 32-token pages would force 32-token K groups (5 bits
per element) and round 10 % of a page up to 4 rows (12.5 %). The tiny model's
head_dim of 64 is also exactly one V group.

Run it with ``jflashloop loops`` or ``python -m jflashloop.apps.loops``.

* :mod:`~jflashloop.apps.loops.runner`: the inputs, the two caches, decoding
  through both, and :func:`run_report`, which gathers every measurement;
* :mod:`~jflashloop.apps.loops.metrics`: the measurements (1-6 above);
* :mod:`~jflashloop.apps.loops.report`: the markdown report;
* :mod:`~jflashloop.apps.loops.cli`: the command's options and :func:`main`;
* :mod:`~jflashloop.apps.loops.policies`: ``jflashloop loops --policies``, other
  storage policies of the loops against FlashLoop's (bytes per token, KL,
  attention error; bench/LOOPS.md section 7).
"""

from .cli import main as main
from .cli import parse_arguments as parse_arguments
from .metrics import attention_errors as attention_errors
from .metrics import bits_per_byte as bits_per_byte
from .metrics import chain_errors as chain_errors
from .metrics import leading_agreement as leading_agreement
from .metrics import logit_metrics as logit_metrics
from .metrics import packed_positions as packed_positions
from .metrics import sparse_row_positions as sparse_row_positions
from .metrics import storage_summary as storage_summary
from .metrics import successive_loop_cosine as successive_loop_cosine
from .report import describe_inputs as describe_inputs
from .report import describe_sparse_rule as describe_sparse_rule
from .report import format_report as format_report
from .runner import DEFAULT_CHECKPOINT as DEFAULT_CHECKPOINT
from .runner import PAGE_SIZE as PAGE_SIZE
from .runner import ReportSettings as ReportSettings
from .runner import bfloat16_dense_attention as bfloat16_dense_attention
from .runner import bfloat16_loop_caches as bfloat16_loop_caches
from .runner import bfloat16_round_trip as bfloat16_round_trip
from .runner import compare_caches as compare_caches
from .runner import cross_loop_cache_config as cross_loop_cache_config
from .runner import decode_tokens as decode_tokens
from .runner import greedy_tokens as greedy_tokens
from .runner import held_out_windows as held_out_windows
from .runner import model_queries as model_queries
from .runner import packed_pages_per_sequence as packed_pages_per_sequence
from .runner import prefill_cross_loop_cache as prefill_cross_loop_cache
from .runner import prefilled_cache_errors as prefilled_cache_errors
from .runner import reconstruct_every_loop as reconstruct_every_loop
from .runner import run_report as run_report
