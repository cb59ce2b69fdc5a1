"""Deprecated path of :mod:`jflashloop.apps.quality` (removed in the next release).

``Policy`` is :class:`jflashloop.cache_config.Policy`; the float64 measures are
in :mod:`jflashloop.apps.float64_metrics` (``logit_kl`` is ``kl_divergence``,
``agreement`` is ``next_token_agreement``).
"""

from ._deprecation import warn_moved
from .apps.float64_metrics import causal_attention_float64 as causal_attention_float64
from .apps.float64_metrics import kl_divergence, next_token_agreement
from .apps.float64_metrics import negative_log_likelihoods as negative_log_likelihoods
from .apps.float64_metrics import relative_error as relative_error
from .apps.quality import DEFAULT_POLICY as DEFAULT_POLICY
from .apps.quality import RECOMMENDED_POLICY as RECOMMENDED_POLICY
from .apps.quality import codec_family_policies as codec_family_policies
from .apps.quality import kv_errors as kv_errors
from .apps.quality import reconstructed_kv as reconstructed_kv
from .apps.quality import standard_policies as standard_policies
from .apps.quality import teacher_forced_logits as teacher_forced_logits
from .cache._config import Policy as Policy

logit_kl = kl_divergence
agreement = next_token_agreement

warn_moved(__name__, "jflashloop.apps.quality")
