"""Deprecated path of :mod:`jflashloop.apps.calibration` (removed in the next release).

``python -m jflashloop.calibration`` still runs; ``python -m
jflashloop.apps.calibration`` is the supported form.
"""

import sys

from ._deprecation import warn_moved
from .apps.calibration import attention_error as attention_error
from .apps.calibration import calibrate_key_clipping as calibrate_key_clipping
from .apps.calibration import calibrate_nvfp4_scale as calibrate_nvfp4_scale
from .apps.calibration import causal_attention as causal_attention
from .apps.calibration import fake_int4_channel as fake_int4_channel
from .apps.calibration import fake_nvfp4 as fake_nvfp4
from .apps.calibration import held_out_errors as held_out_errors
from .apps.calibration import main as main

warn_moved(__name__, "jflashloop.apps.calibration")

if __name__ == "__main__":
    warn_moved("python -m jflashloop.calibration", "python -m jflashloop.apps.calibration",
               stacklevel=2)
    sys.exit(main())
