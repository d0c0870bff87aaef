"""benchmarks/padding_free.py's own arithmetic: the window of steps it counts tokens over, and the flags a run gets
(--extra after the fixed shapes, so that a GPU run's batch size replaces the CPU's)."""

import json

import tyro

from benchmarks import padding_free


def test_count_window_is_steps_2_to_n_from_the_first_line_of_each_step_with_the_gpu_peak(tmp_path):
    path = tmp_path / "counts.jsonl"
    rows = [{"step": 1, "fed": 100, "real": 60}, {"step": 2, "fed": 250, "real": 150, "gpu_mib": 10.0},
            {"step": 2, "fed": 999, "real": 999}, {"step": 4, "fed": 700, "real": 420, "gpu_mib": 12.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert padding_free.count_window(str(path)) == {"fed": 600, "real": 360, "steps": 3, "peak_gpu_mib": 12.5}
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "gpu_mib"}) + "\n" for r in rows))
    assert "peak_gpu_mib" not in padding_free.count_window(str(path))  # a CPU run


def test_extra_flags_come_after_the_shapes_and_the_packed_run_alone_is_padding_free():
    from algos import sft
    args = padding_free.Args(model="smollm2", steps=4, extra="--bf16 --per_device_train_batch_size 32")
    parsed = {variant: tyro.cli(sft.Args, args=padding_free.script_argv("sft", args, "m", "d.jsonl", variant, "out"))
              for variant in padding_free.VARIANTS}
    assert padding_free.SHAPES["smollm2"]["sft"][:2] == ["--per_device_train_batch_size", "4"]
    assert all(a.per_device_train_batch_size == 32 and a.model.bf16 for a in parsed.values())
    assert parsed["packed"].packing.padding_free and not parsed["padded"].packing.padding_free
    assert parsed["packed"].max_length == 512 and parsed["packed"].max_steps == 4
