"""`accelerate launch --num_processes 2 tests/reward_extras_probe.py OUT`: each rank logs through log_metric (rank 0:
both 1 and 2; rank 1: both 3 and only_rank_1 5), flushes, and writes what it got to OUT<rank>.json."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accelerate import Accelerator  # noqa: E402

from common.reward_extras import RewardExtras  # noqa: E402
from common.runtime import end_processes  # noqa: E402

if __name__ == "__main__":
    accelerator = Accelerator()
    extras = RewardExtras(accelerator, argparse.Namespace(max_steps=10, reward_timeout=0), epoch_size=4)
    extras.caller(0, 0)
    if accelerator.process_index == 0:
        extras.log_metric("both", 1.0)
        extras.log_metric("both", 2.0)
    else:
        extras.log_metric("only_rank_1", 5.0)
        extras.log_metric("both", 3.0)
    flushed = extras.flush()
    with open(f"{sys.argv[1]}{accelerator.process_index}.json", "w") as f:
        json.dump(flushed, f)
    end_processes()  # leaves without the interpreter's teardown, which aborts a gloo rank now and then
