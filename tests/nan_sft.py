"""algos/sft.py whose loss is NaN at its $NAN_CALL-th call on the process of rank $NAN_RANK only (launched
by tests/test_deepspeed.py: a non-finite value on one rank must stop every rank alike)."""

import os

import tyro

from algos import sft
from common.runtime import exit_on_user_error, stop_on_signal

calls, loss = [0], sft.sft_loss


def nan_once(*args, **kwargs):
    calls[0] += 1
    bad = calls[0] == int(os.environ["NAN_CALL"]) and os.environ.get("RANK", "0") == os.environ.get("NAN_RANK", "0")
    return loss(*args, **kwargs) * (float("nan") if bad else 1.0)


if __name__ == "__main__":
    sft.sft_loss = nan_once
    with exit_on_user_error(), stop_on_signal():
        sft.main(tyro.cli(sft.Args))
