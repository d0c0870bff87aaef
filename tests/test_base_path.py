"""The base path (one turn, HF generate, in turn) of grpo and rloo stays in the script and the core: a run without
--use_vllm, --tools / --environment_factory, --max_staleness and --vllm_importance_sampling_cap, and with reward
functions that ask for none of TRL's extras (no trainer_state, log_metric, log_extra, **kwargs or async def:
common/reward_extras.py), calls no function of a feature module (issue 56; tests/test_layout.py lists them)."""

import importlib
import os
import sys
import threading

import pytest

from common import episodes
from tests.conftest import ROOT, script_args
from tests.test_layout import FEATURES

FEATURE_FILES = {os.path.join(ROOT, "common", f"{m}.py") for m in FEATURES}
SMALL = {"grpo": dict(num_generations=2), "rloo": dict(rloo_k=2, num_mini_batches=1)}


def feature_calls(run) -> set:
    """The functions of feature modules that run() calls, in any thread."""
    entered = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in FEATURE_FILES:
            entered.add(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return entered


def test_the_probe_sees_a_feature_call():
    assert "episodes.py:parse_tool_calls" in feature_calls(lambda: episodes.parse_tool_calls("no call", "hermes"))


@pytest.mark.parametrize("script", ["grpo", "rloo"])
def test_a_base_run_calls_no_function_of_a_feature_module(tmp_path, tiny_model, script):
    module = importlib.import_module(f"algos.{script}")
    args = script_args(module.Args, model_name_or_path=tiny_model, reward_model_paths=[],
                       reward_funcs=["tests.toy_rewards:words"], max_steps=1, per_device_train_batch_size=4,
                       max_completion_length=4, output_dir=str(tmp_path / script), **SMALL[script])
    assert feature_calls(lambda: module.main(args)) == set()
    assert os.path.isfile(tmp_path / script / "model.safetensors")
