"""The old module paths of the applications and model hooks: importable for one release, with a warning."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from jflashloop import Policy
from jflashloop.apps import calibration, cli, demo, evaluation, float64_metrics, loops, quality
from jflashloop.models import cache_hooks

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]

# old path -> (new path, {old name: the object it must be})
MOVED = {
    "jflashloop.cli": ("jflashloop.apps.cli", {"main": cli.main}),
    "jflashloop.demo": ("jflashloop.apps.demo", {"run": demo.run, "add_arguments": demo.add_arguments}),
    "jflashloop.evaluation": ("jflashloop.apps.evaluation", {
        "main": evaluation.main, "evaluate": evaluation.evaluate,
        "markdown_table": evaluation.markdown_table}),
    "jflashloop.calibration": ("jflashloop.apps.calibration", {
        "main": calibration.main, "calibrate_key_clipping": calibration.calibrate_key_clipping,
        "fake_nvfp4": calibration.fake_nvfp4}),
    "jflashloop.quality": ("jflashloop.apps.quality", {
        "Policy": Policy, "DEFAULT_POLICY": quality.DEFAULT_POLICY,
        "standard_policies": quality.standard_policies, "kv_errors": quality.kv_errors,
        "teacher_forced_logits": quality.teacher_forced_logits,
        "logit_kl": float64_metrics.kl_divergence, "agreement": float64_metrics.next_token_agreement,
        "negative_log_likelihoods": float64_metrics.negative_log_likelihoods,
        "causal_attention_float64": float64_metrics.causal_attention_float64}),
    "jflashloop.loops_report": ("jflashloop.apps.loops", {
        "main": loops.main, "compare_caches": loops.compare_caches, "run_report": loops.run_report,
        "format_report": loops.format_report, "ReportSettings": loops.ReportSettings,
        "kl_divergence": float64_metrics.kl_divergence,
        "DEFAULT_CHECKPOINT": loops.DEFAULT_CHECKPOINT}),
    "jflashloop.generation": ("jflashloop.models.cache_hooks", {
        "paged_attention_hook": cache_hooks.paged_attention_hook,
        "looped_paged_attention_hook": cache_hooks.looped_paged_attention_hook,
        "prefill_one_loop": cache_hooks.prefill_one_loop}),
}


@pytest.mark.parametrize("old", list(MOVED))
def test_old_path_warns_and_gives_the_moved_objects(old):
    new, names = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}") as record:
        module = __import__(old, fromlist=["_"])  # a plain import: the warning names this file
    assert [Path(warning.filename) for warning in record] == [Path(__file__)]
    for name, expected in names.items():
        assert getattr(module, name) is expected, name
    assert importlib.import_module(new) is not module


def test_new_paths_do_not_warn():
    imports = "; ".join(f"import {new}" for new, _ in MOVED.values())
    ran = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", imports],
                         capture_output=True, text=True, timeout=300, cwd=REPOSITORY_ROOT, check=False)
    assert ran.returncode == 0, ran.stderr
    assert "moved to" not in ran.stderr, ran.stderr


@pytest.mark.parametrize("old, new", [
    ("jflashloop.cli", "python -m jflashloop"),
    ("jflashloop.evaluation", "jflashloop eval"),
    ("jflashloop.calibration", "python -m jflashloop.apps.calibration"),
    ("jflashloop.loops_report", "jflashloop loops"),
])
def test_old_python_dash_m_commands_still_run(old, new):
    ran = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True,
                         timeout=300, cwd=REPOSITORY_ROOT, check=False)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("usage: ")
    assert f"python -m {old} moved to {new}" in ran.stderr  # shown by default


def test_python_dash_m_apps_commands_run():
    for module in ("jflashloop.apps.loops", "jflashloop.apps.evaluation", "jflashloop.apps.calibration"):
        ran = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                             text=True, timeout=300, cwd=REPOSITORY_ROOT, check=False)
        assert ran.returncode == 0 and ran.stdout.startswith("usage: "), (module, ran.stderr)
        assert "Deprecat" not in ran.stderr, module
