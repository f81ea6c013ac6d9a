"""What every sampling program of this folder shares: the exported folder's model, tokenizer and settings, the
prompt's ids, the denoiser's bidirectional forward and the command line. The model card inlines it into each
program (`tasks.commands.snippets.program`), so what a user copies needs nothing but torch and transformers."""

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_export(folder, device="cpu"):
    """(model, tokenizer, settings) of an exported folder. `settings` is its generation_config.json (token ids,
    the sampler's `dllm_*` settings, the strategy's options `dllm_options`) with what config.json says about the
    denoiser: how it attends (`dllm_attention`) and whether it reads the noise level (`dllm_time_conditioning`)."""
    folder = Path(folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    settings["folder"] = str(folder)
    settings["dllm_attention"] = config.get("dllm_attention", "bidirectional_4d")
    settings["dllm_time_conditioning"] = bool(config.get("dllm_time_conditioning"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # the dtype dllm-flow builds the model in: the config's, else float32
    dtype = getattr(torch, config.get("dtype") or "float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model, tokenizer, settings


def prompt_ids(tokenizer, text, settings):
    """The prompt's ids as dllm-flow encodes them: no special tokens added; a chat model's prompt goes through
    the chat template first."""
    if settings.get("dllm_chat"):
        message = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def denoiser_logits(model, ids, settings, embeds=None):
    """Logits [1, T, V] of the denoiser over `ids` [1, T] (or their embeddings `embeds`), every position attending
    to every other. Bidirectionality is not in the weights: transformers uses a 4-D boolean attention mask as
    given, so an all-True one turns the causal backbone into the bidirectional denoiser dllm-flow trained. A model
    that attends bidirectionally by itself (`dllm_attention: native`) takes no mask."""
    inputs = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
    if settings["dllm_attention"] != "native":
        length = ids.shape[1]
        inputs["attention_mask"] = torch.ones(1, 1, length, length, dtype=torch.bool, device=ids.device)
    return model(**inputs, use_cache=False).logits


def until_eos(ids, eos_id):
    """The generated ids before the first EOS (what dllm-flow prints)."""
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def dllm_flow_command(folder, prompt, settings, seed):
    """The `dllm-flow generate` command that samples what this program samples: every sampler setting spelled
    out, since dllm-flow's own defaults are not the export's generation_config.json."""
    command = ["dllm-flow", "generate", "--checkpoint", str(folder), "--prompt", prompt, "--temperature", "0"]
    command += ["--steps", str(settings["dllm_steps"]), "--block-size", str(settings["dllm_block_size"])]
    command += ["--max-new-tokens", str(settings["max_new_tokens"]), "--remasking", settings["dllm_remasking"]]
    if settings.get("dllm_threshold") is not None:
        command += ["--threshold", str(settings["dllm_threshold"])]
    return shlex.join([*command, "--seed", str(seed)])


def main(sample):
    """`python PROGRAM EXPORT_DIR PROMPT`: prints the text `sample(model, prompt ids, settings, generator)` generates
    (with --ids, its token ids as JSON), and on stderr the `dllm-flow generate` command that prints the same. Unset
    flags take the export's generation_config.json values."""
    parser = argparse.ArgumentParser(description="Sample from a dllm-flow export at temperature 0.")
    parser.add_argument("folder", help="the exported folder")
    parser.add_argument("prompt")
    parser.add_argument("--steps", type=int, help="denoising steps (default: dllm_steps)")
    parser.add_argument("--block-size", type=int, help="default: dllm_block_size")
    parser.add_argument("--max-new-tokens", type=int, help="default: max_new_tokens")
    parser.add_argument("--seed", type=int, default=42, help="for the sampler's random draws (dllm-flow's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ids", action="store_true", help="print the generated token ids instead of the text")
    args = parser.parse_args()
    model, tokenizer, settings = load_export(args.folder, args.device)
    flags = {"dllm_steps": args.steps, "dllm_block_size": args.block_size, "max_new_tokens": args.max_new_tokens}
    settings.update({key: value for key, value in flags.items() if value is not None})
    print(f"same tokens as: {dllm_flow_command(args.folder, args.prompt, settings, args.seed)}", file=sys.stderr)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    with torch.no_grad():
        ids = sample(model, prompt_ids(tokenizer, args.prompt, settings), settings, generator)
    ids = until_eos(ids, settings.get("eos_token_id"))
    print(json.dumps(ids) if args.ids else tokenizer.decode(ids))
