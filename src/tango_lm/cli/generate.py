"""Using a trained checkpoint: `generate`, `serve` and `export`."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from tango_lm.cli.output import CHECKPOINT_HELP, DEVICE_HELP, JSON_HELP, _print_json
from tango_lm.errors import UserError, path_arg


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from tango_lm.config_checks import check_decode_fits_memory
    from tango_lm.data.tokenizers import tokenizer_from_dict
    from tango_lm.serve.generate import check_sampling, generate, room_for_new_tokens
    from tango_lm.train.checkpoint import load_checkpoint
    from tango_lm.train.device import pick_device

    # before the slow load
    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens or 0, args.seed)
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1 (got {args.num_samples})")
    prompt_text = _unescaped(_utf8_prompt(args.prompt))
    ckpt = load_checkpoint(args.checkpoint)
    device = pick_device(args.device)
    model = ckpt.build_model(device)
    tok = tokenizer_from_dict(ckpt.tokenizer)
    ids = tok.encode(prompt_text) or [tok.eot_id]  # an empty prompt starts a document, as the server's
    room = room_for_new_tokens(len(ids), model.config.context_length)
    if room < 1:
        raise UserError(
            f"the prompt has {len(ids)} tokens, more than the model's context of "
            f"{model.config.context_length}; shorten it"
        )
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, room)
    check_decode_fits_memory(model.config, device, args.num_samples, len(ids) + max_new_tokens, "--num-samples")
    if note := ckpt.untrained_positions_note(len(ids) + max_new_tokens - 1, "the prompt with its new tokens"):
        print(note, file=sys.stderr)
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    out = generate(
        model,
        prompt,
        max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=None if args.no_stop else tok.eot_id,
        vocab_size=tok.vocab_size,
        static=None if args.eager else "auto",
    )
    texts = []
    for row in out.tolist():
        new = row[len(ids) :]
        if not args.no_stop and tok.eot_id in new:
            new = new[: new.index(tok.eot_id)]
        texts.append(tok.decode(new))
    if args.max_new_tokens is None and room < DEFAULT_NEW_TOKENS:
        new_tokens = f"{room} new token" + ("s" if room != 1 else "")
        prompt_fills = f"{len(ids)} token" + ("s fill" if len(ids) != 1 else " fills")
        print(
            f"note: at most {new_tokens} (not {DEFAULT_NEW_TOKENS}): the prompt's {prompt_fills} the rest of the "
            f"model's context of {model.config.context_length}",
            file=sys.stderr,
        )
    if args.json:
        _print_json({"prompt": prompt_text, "completions": texts, "checkpoint": str(ckpt.path)})
        return
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(prompt_text + text)


def cmd_serve(args: argparse.Namespace) -> None:
    import importlib.util

    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise UserError("tango-lm serve needs FastAPI and uvicorn; pip install 'tango-lm[serve]'")
    from tango_lm.serve.server import serve

    serve(
        args.checkpoint,
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        device=args.device,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        threads=args.threads,
    )


DEFAULT_NEW_TOKENS = 64


def _utf8_prompt(text: str) -> str:
    """The prompt, or a UserError when the shell passed bytes that are not UTF-8 (Python keeps
    them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"character U+{bad:04X}"
        raise UserError(f"--prompt is not valid UTF-8 ({byte} at character {exc.start}); pass UTF-8 text") from None
    return text


def cmd_export(args: argparse.Namespace) -> None:
    from tango_lm.serve.hf_export import export_hf

    out = export_hf(args.checkpoint, args.hf, overwrite=args.overwrite)
    if args.json:
        _print_json(out)
    else:
        print(
            f"exported {out['checkpoint']} to {out['hf_dir']}; load it with AutoModelForCausalLM.from_pretrained("
            f"{out['hf_dir']!r}, trust_remote_code=True) where tango-lm is installed"
        )


def _unescaped(prompt: str) -> str:
    """The prompt as a shell cannot easily write it: `\\n` a newline and `\\\\` one backslash (so
    `print("x\\\\n")` reaches the model as written); any other backslash stays as it is."""
    return re.sub(r"\\(\\|n)", lambda m: "\n" if m.group(1) == "n" else "\\", prompt)


def add_parsers(sub: Any) -> None:
    """`generate`, `serve`, `export`."""
    s = sub.add_parser("generate", help="sample text from a checkpoint")
    s.add_argument("checkpoint", help=CHECKPOINT_HELP)
    s.add_argument("--prompt", required=True, help="text to continue (\\n for a newline, \\\\ for a backslash)")
    s.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="default 64, or as many as the prompt leaves room for in the context",
    )
    s.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only")
    s.add_argument("--top-p", type=float, default=None, help="sample within the smallest set of probability >= p")
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (default: a fresh one each run); the same seed, the same samples",
    )
    s.add_argument("--num-samples", type=int, default=1, help="completions of the prompt, decoded together")
    s.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    s.add_argument("--device", default="auto", help=DEVICE_HELP)
    s.add_argument(
        "--eager",
        action="store_true",
        help="on CUDA too, decode with the eager cached forward instead of compiled static steps (CUDA graphs): "
        "no compile wait for a short answer; a seed then draws other samples (greedy tokens agree)",
    )
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve a checkpoint over HTTP with the OpenAI completions API")
    s.add_argument("checkpoint", help=CHECKPOINT_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (the address is printed)")
    s.add_argument("--model-name", default=None, help="the model id clients send (default: the run directory's name)")
    s.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together at most")
    s.add_argument(
        "--batch-wait-ms",
        type=float,
        default=20.0,
        help="how long the first request of a batch waits for others to arrive",
    )
    s.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch (default: PyTorch's choice)")
    s.add_argument("--device", default="auto", help=DEVICE_HELP)
    s.set_defaults(func=cmd_serve, outlives_reader=True)

    s = sub.add_parser("export", help="write a checkpoint as a Hugging Face transformers directory")
    s.add_argument("checkpoint", help=CHECKPOINT_HELP)
    s.add_argument(
        "--hf", required=True, type=path_arg, metavar="DIR", help="output directory (AutoModelForCausalLM, remote code)"
    )
    s.add_argument("--overwrite", action="store_true", help="replace the export's files in a non-empty DIR")
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_export, outlives_reader=True)
