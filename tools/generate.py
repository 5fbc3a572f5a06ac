#!/usr/bin/env python
"""Generate text from a megalite checkpoint at any TP/PP layout, with a KV cache.

    python tools/generate.py --load ckpt --prompt "def main(" --max-new-tokens 40 --greedy
    python tools/generate.py --load ckpt --prompt "import os" --temperature 0.8 --top-k 40 --seed 7
    torchrun --nproc-per-node 4 tools/generate.py --load ckpt --prompts-file prompts.txt --top-p 0.9 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Sampling is the default (temperature 1, no top-k/top-p), as in Megatron; ``--greedy`` takes the argmax.
The same checkpoint, prompts, flags and ``--seed`` give the same text. The model and its tokenizer come
from the checkpoint (tokenizer flags override). Generation stops at ``--max-new-tokens`` or at the
end-of-document token (unless ``--ignore-eod``). The last rank prints each prompt and its sample.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megalite.config.domain import MAX_SIZE, Domain, domain_option, in_fp32  # noqa: E402
from megalite.config.validate import ConfigError  # noqa: E402
from megalite.inference.generation import GenerationError, check_lengths, generate  # noqa: E402
from megalite.inference.loading import (  # noqa: E402
    check_output_file,
    inference_parser,
    last_rank,
    load_model,
    plan,
    tokenize_checked,
)
from megalite.inference.sampling import SamplingParams  # noqa: E402
from megalite.launch.run import distributed_run, exit_process, launcher_env  # noqa: E402
from megalite.launch.tool_errors import atomic_output, tool_main  # noqa: E402


def build_parser():
    parser = inference_parser("Generate text from a checkpoint (greedy, temperature, top-k, top-p; KV cache; "
                              "any TP/PP layout).")
    g = parser.tool
    g.add_argument("--prompt", action="append", default=[], help="A prompt (repeat for a batch). An empty "
                   "prompt generates unconditionally, from the end-of-document token.")
    g.add_argument("--prompts-file", default=None, help="A text file of prompts, one per line (\\n escapes "
                   "allowed).")
    domain_option(g, "--max-new-tokens", integer=True, default=64, help="Tokens to generate after each prompt.",
                  domain=Domain(lo=1, hi=MAX_SIZE, off=0, off_means="generates nothing: the prompts are printed"))
    g.add_argument("--greedy", action="store_true", help="Take the most likely token (no sampling).")
    domain_option(g, "--temperature", integer=False, default=1.0, help="Divide the logits by this before sampling.",
                  domain=in_fp32(Domain(lo=0, lo_open=True, off=0, off_means="is greedy")))
    domain_option(g, "--top-k", integer=True, default=0, help="Sample among the k most likely tokens.",
                  domain=Domain(lo=1, hi=MAX_SIZE, off=0, off_means="samples among all tokens"))
    domain_option(g, "--top-p", integer=False, default=0.0, help="Sample among the most likely tokens holding "
                  "this much probability (1: all).",
                  domain=Domain(lo=0, lo_open=True, hi=1, off=0, off_means="samples among all tokens"))
    g.add_argument("--no-kv-cache", action="store_true", help="Recompute the whole sequence every step "
                   "(slower; the same tokens).")
    g.add_argument("--ignore-eod", action="store_true", help="Keep generating past the end-of-document token.")
    g.add_argument("--output-json", default=None, help="Also write prompts, token ids and texts to this file.")
    return parser


def _prompts(args) -> list[tuple[str, str]]:
    """(text, where it came from) of every prompt."""
    prompts = [(t, f"--prompt {t[:40]!r}") for t in args.prompt]
    if args.prompts_file:
        path = args.prompts_file
        if not os.path.isfile(path):
            raise ConfigError(f"--prompts-file {path}: " + ("a directory, not a file" if os.path.isdir(path)
                                                              else "no such file"))
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"--prompts-file {path}, line {n}: not UTF-8 text (byte {e.start} of the "
                                      f"line)") from None
                if line.strip():
                    prompts.append((line.rstrip("\r\n").replace("\\n", "\n"), f"--prompts-file {path}, line {n}"))
        if not any(where.startswith("--prompts-file") for _, where in prompts):
            raise ConfigError(f"--prompts-file {path} is empty (no line with a prompt); give one prompt a line")
    if not prompts:
        raise ConfigError("give --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def run(argv: list[str] | None = None, say=print):
    """Parse, check, generate; the GenerationResult on every rank (printed by the last one)."""
    given, args = build_parser().parse(argv)
    _, world, _, _ = launcher_env()
    p = plan(given, world)
    check_output_file("--output-json", args.output_json)
    tok = p.tokenizer
    texts, prompts = [], []
    for text, where in _prompts(args):
        texts.append(text)
        prompts.append(tokenize_checked(tok, text, p.vocab_size, where) if text else [tok.eod])
    try:
        params = SamplingParams(args.greedy, args.temperature, args.top_k, args.top_p)
        check_lengths(p.cfg.model, [len(x) for x in prompts], args.max_new_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    seed = p.cfg.training.seed
    with distributed_run(p.cfg) as pg:
        chunks = load_model(p, pg)
        start = time.perf_counter()
        result = generate(chunks, pg, prompts, args.max_new_tokens, params, seed=seed,
                          use_cache=not args.no_kv_cache, stop_token=None if args.ignore_eod else tok.eod,
                          pad_token=tok.eod)
        elapsed = time.perf_counter() - start
        if last_rank(pg):
            how = "greedy" if params.is_greedy else (
                f"temperature {params.temperature}" + (f", top-k {params.top_k}" if params.top_k else "")
                + (f", top-p {params.top_p}" if params.top_p else "") + f", seed {seed}")
            samples = [tok.detokenize(t) for t in result.tokens]
            for i, (text, sample, new) in enumerate(zip(texts, samples, result.new_tokens), 1):
                say(f"----- prompt {i} ({len(prompts[i - 1])} tokens) -----\n{text}")
                say(f"----- sample {i} ({len(new)} new tokens, {how}) -----\n{sample}")
            n = sum(len(x) for x in result.new_tokens)
            say(f" > generated {n} tokens in {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tokens/s, KV cache "
                f"{'off' if args.no_kv_cache else 'on'}, TP={pg.tp_size} PP={pg.pp_size})")
            if args.output_json:
                with atomic_output(args.output_json) as tmp, open(tmp, "w") as f:
                    json.dump([{"prompt": t, "prompt_tokens": x, "tokens": r, "text": s}
                               for t, x, r, s in zip(texts, prompts, result.tokens, samples)], f, indent=1)
    return result


def main(argv: list[str] | None = None) -> int:
    return tool_main("generate.py", lambda: _main(argv), error_status=2)


def _main(argv: list[str] | None) -> int:
    try:
        run(argv)
    except (ConfigError, GenerationError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())
