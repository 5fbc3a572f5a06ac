"""Promise: bad input to any entry point is refused by name. Each case below goes through one of the five
real entry points (pretrain_gpt.py, tools/preprocess_data.py, tools/convert_checkpoint.py reshard/to-hf/
from-hf, tools/generate.py, tasks/main.py) and must: exit non-zero, print no Python traceback, print on
stderr an error that names the flag / file / line (each expected text), leave every existing checkpoint
byte-identical (all files hashed before and after) and create nothing at the output it was given.

Speed: an interpreter that imports torch costs seconds, so one server process (this file run as a script)
imports every entry point once and forks a fresh child per case, which runs the script's ``main(argv)``
with its own stdout/stderr files and exit status, exactly what ``python script.py argv`` runs after its
imports. ``MEGALITE_BAD_INPUTS_EXEC=1`` runs every case as a real ``python script.py ...`` instead (slower,
same assertions). Control cases (the same fixtures, valid flags) must succeed, so a refusal is specific.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.cli_utils import launch_pretrain, load_tool, refused, tree_hash
from tests.data_fixtures import random_indexed

ROOT = Path(__file__).resolve().parents[1]
ENTRY = {"pretrain": "pretrain_gpt.py", "preprocess": "tools/preprocess_data.py",
         "convert": "tools/convert_checkpoint.py", "generate": "tools/generate.py", "tasks": "tasks/main.py"}
CASE_TIMEOUT = 60  # seconds; a case that runs longer is reported as a hang


@dataclass(frozen=True)
class Case:
    id: str
    entry: str  # a key of ENTRY
    argv: tuple[str, ...]  # {placeholders} filled from the fixture paths; {new} is a fresh output path
    expected: tuple[str, ...]  # texts stderr must hold (formatted like argv)


def case(id: str, entry: str, argv: str, *expected: str) -> Case:
    return Case(id, entry, tuple(argv.split()), expected)


TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 2 --eval-iters 0 --train-iters 1")
DATA = f"{TINY} --split 1,0,0 --data-path {{data}}"
NULL = "--tokenizer-type NullTokenizer --vocab-size 128"
MOE = "--num-experts 4 --disable-bias-linear"
BPE = "--tokenizer-type GPT2BPETokenizer"
SWAPPED = "did you swap --vocab-file and --merge-file?"
NO_CKPT = "no latest_checkpointed_iteration.txt there"
TOK = "--load {ck} --prompt 1 --max-new-tokens 2"  # generate: a valid command but for the flag under test
WIKI = "--task WIKITEXT103 --overlapping-eval 8 --load {ck}"
NOT_UTF8 = "not UTF-8 text"
NOT_CP = "context parallelism is not supported in tasks/generation"

CASES = [
    # ---- pretrain_gpt.py: data, tokenizer and checkpoint files ---------------------------------------------
    case("pretrain-vocab-is-merges", "pretrain", f"{DATA} {BPE} --vocab-file {{merges}} --merge-file {{merges}}",
         "--vocab-file {merges} is not a GPT-2 vocab.json", SWAPPED),
    case("pretrain-merges-is-vocab", "pretrain", f"{DATA} {BPE} --vocab-file {{vocab}} --merge-file {{vocab}}",
         "--merge-file {vocab} is JSON, not a merges.txt", SWAPPED),
    case("pretrain-not-sentencepiece", "pretrain",
         f"{DATA} --tokenizer-type SentencePieceTokenizer --tokenizer-model {{vocab}}",
         "--tokenizer-model {vocab} is not a SentencePiece model", "--tokenizer-type HuggingFaceTokenizer"),
    case("pretrain-not-tokenizer-json", "pretrain",
         f"{DATA} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {{merges}}",
         "--tokenizer-model {merges} is not a Hugging Face tokenizer.json"),
    case("pretrain-vocab-missing", "pretrain", f"{DATA} {BPE} --vocab-file {{d}}/nope.json --merge-file {{merges}}",
         "--vocab-file {d}/nope.json: no such file"),
    case("pretrain-data-missing", "pretrain", f"{TINY} --split 1,0,0 --data-path {{d}}/nope {NULL}",
         "{d}/nope.idx not found"),
    case("pretrain-corrupt-idx", "pretrain", f"{TINY} --split 1,0,0 --data-path {{corrupt}} {NULL}",
         "{corrupt}.idx: not an indexed dataset index"),
    case("pretrain-bad-split", "pretrain", f"{DATA} --split a,b {NULL}", "--split 'a,b'"),
    case("pretrain-cache-path-is-file", "pretrain", f"{DATA} {NULL} --data-cache-path {{vocab}}",
         "{vocab}", "--data-cache-path"),
    case("pretrain-load-not-checkpoint", "pretrain", f"{TINY} --mock-data --vocab-size 128 --load {{empty}}",
         f"--load {{empty}}: {NO_CKPT}"),
    case("pretrain-load-other-model", "pretrain", f"{TINY} --mock-data --vocab-size 128 --load {{ck}} "
         "--num-layers 4", "--load {ck}: the checkpoint's model differs", "--num-layers: checkpoint 2, flags 4"),
    case("pretrain-save-another-run", "pretrain", f"{TINY} --mock-data --vocab-size 128 --save {{ck_copy}}",
         "--save {ck_copy} already holds a checkpoint", "--overwrite-checkpoint"),
    # ---- pretrain_gpt.py: mixture of experts ----------------------------------------------------------------
    case("pretrain-moe-bias", "pretrain", f"{TINY} --mock-data {NULL} --num-experts 4",
         "--num-experts needs --disable-bias-linear"),
    case("pretrain-moe-layer-freq", "pretrain", f"{TINY} --mock-data {NULL} {MOE} --moe-layer-freq [1,x]",
         "--moe-layer-freq '[1,x]' is neither an integer nor a list"),
    case("pretrain-moe-ep-over-world", "pretrain", f"{TINY} --mock-data {NULL} {MOE} --expert-model-parallel-size 2",
         "--expert-model-parallel-size (2) x --expert-tensor-parallel-size (1) must divide the ranks of a pipeline "
         "stage (1 = TP 1 x CP 1 x DP 1)"),
    case("pretrain-moe-dispatcher", "pretrain", f"{TINY} --mock-data {NULL} {MOE} --moe-token-dispatcher-type a2a",
         "--moe-token-dispatcher-type", "'a2a'"),
    case("pretrain-moe-pad-without-capacity", "pretrain",
         f"{TINY} --mock-data {NULL} {MOE} --moe-pad-expert-input-to-capacity",
         "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    # ---- pretrain_gpt.py: sizes no host holds, refused before any allocation (megalite/planning/memory_check.py)
    case("pretrain-vocab-past-memory", "pretrain", f"{TINY} --mock-data --vocab-size 50000000 --hidden-size 4096",
         "memory check: the planner estimates", "--vocab-size 50000000 x --hidden-size 4096", "--skip-memory-check"),
    case("pretrain-seq-length-past-memory", "pretrain",
         f"{TINY} --mock-data {NULL} --hidden-size 1024 --seq-length 4000000 --max-position-embeddings 4000000",
         "memory check: the planner estimates", "--seq-length 4000000 x --micro-batch-size 2"),
    # ---- tools/preprocess_data.py --------------------------------------------------------------------------
    case("preprocess-input-missing", "preprocess", f"--input {{d}}/nope.jsonl --output-prefix {{new}} {NULL}",
         "--input {d}/nope.jsonl: no such file"),
    case("preprocess-not-json", "preprocess", f"--input {{text}} --output-prefix {{new}} {NULL}",
         "{text}:1: malformed JSON", "--skip-bad-lines"),
    case("preprocess-missing-key", "preprocess",
         f"--input {{jsonl}} --json-keys content --output-prefix {{new}} {NULL}", "{jsonl}:1: missing key 'content'"),
    case("preprocess-not-utf8", "preprocess", f"--input {{latin1}} --output-prefix {{new}} {NULL}",
         f"{{latin1}}:2: {NOT_UTF8}"),
    case("preprocess-output-dir-missing", "preprocess", f"--input {{jsonl}} --output-prefix {{d}}/nodir/out {NULL}",
         "--output-prefix {d}/nodir/out: output directory {d}/nodir does not exist"),
    case("preprocess-output-under-file", "preprocess", f"--input {{jsonl}} --output-prefix {{vocab}}/out {NULL}",
         "--output-prefix {vocab}/out: {vocab} is a file, not a directory"),
    case("preprocess-vocab-is-merges", "preprocess",
         f"--input {{jsonl}} --output-prefix {{new}} {BPE} --vocab-file {{merges}} --merge-file {{vocab}}",
         "--vocab-file {merges} is not a GPT-2 vocab.json", SWAPPED),
    case("preprocess-merges-is-vocab", "preprocess",
         f"--input {{jsonl}} --output-prefix {{new}} {BPE} --vocab-file {{vocab}} --merge-file {{vocab}}",
         "--merge-file {vocab} is JSON", SWAPPED),
    case("preprocess-merges-bad-line", "preprocess",
         f"--input {{jsonl}} --output-prefix {{new}} {BPE} --vocab-file {{vocab}} --merge-file {{text}}",
         "--merge-file {text}, line 1: expected two tokens"),
    case("preprocess-not-sentencepiece", "preprocess",
         "--input {jsonl} --output-prefix {new} --tokenizer-type SentencePieceTokenizer --tokenizer-model "
         "{random}", "--tokenizer-model {random} is not a SentencePiece model"),
    case("preprocess-no-hf-tokenizer-in-folder", "preprocess",
         "--input {jsonl} --output-prefix {new} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {empty}",
         "--tokenizer-model {empty} is a folder without a Hugging Face tokenizer"),
    case("preprocess-words-for-null-tokenizer", "preprocess", f"--input {{words}} --output-prefix {{new}} {NULL}",
         "{words}:1: cannot tokenize 'text': NullTokenizer reads whitespace-separated integer token ids"),
    case("preprocess-workers-0", "preprocess", f"--input {{jsonl}} --output-prefix {{new}} {NULL} --workers 0",
         "argument --workers: must be an integer in [1, ", "got 0"),
    # ---- tools/convert_checkpoint.py reshard ------------------------------------------------------------------
    case("reshard-load-missing", "convert", "reshard --load {d}/nope --save {new}", f"--load {{d}}/nope: {NO_CKPT}"),
    case("reshard-load-is-hf", "convert", "reshard --load {hf} --save {new}",
         "--load {hf} is a Hugging Face folder", "from-hf"),
    case("reshard-existing-destination", "convert", "reshard --load {ck} --save {ck_copy}",
         "--save {ck_copy} exists and is not empty", "--overwrite"),
    case("reshard-onto-source", "convert", "reshard --load {ck} --save {ck} --overwrite",
         "--save {ck} must differ from --load"),
    case("reshard-tp-3", "convert", "reshard --load {ck} --save {new} --tensor-model-parallel-size 3",
         "--tensor-model-parallel-size (3) must divide --num-attention-heads (4)"),
    case("reshard-pp-4", "convert", "reshard --load {ck} --save {new} --pipeline-model-parallel-size 4",
         "--pipeline-model-parallel-size (4) must divide --num-layers (2)"),
    case("reshard-virtual-without-pp", "convert",
         "reshard --load {ck} --save {new} --num-layers-per-virtual-pipeline-stage 1",
         "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    case("reshard-iteration-missing", "convert", "reshard --load {ck} --save {new} --iteration 99",
         "--iteration 99: --load {ck} holds no iter_0000099"),
    # ---- tools/convert_checkpoint.py to-hf ---------------------------------------------------------------------
    case("to-hf-load-missing", "convert", "to-hf --load {d}/nope --save {new}", f"--load {{d}}/nope: {NO_CKPT}"),
    case("to-hf-existing-destination", "convert", "to-hf --load {ck} --save {ck_copy}",
         "--save {ck_copy} exists and is not empty", "--overwrite"),
    case("to-hf-save-under-a-file", "convert", "to-hf --load {ck} --save {vocab}/hf",
         "--save {vocab}/hf: {vocab} is a file, not a directory"),
    case("to-hf-vocab-is-merges", "convert",
         f"to-hf --load {{ck}} --save {{new}} {BPE} --vocab-file {{merges}} --merge-file {{merges}}",
         "--vocab-file {merges} is not a GPT-2 vocab.json", SWAPPED),
    case("to-hf-not-sentencepiece", "convert",
         "to-hf --load {ck} --save {new} --tokenizer-type SentencePieceTokenizer --tokenizer-model {random}",
         "--tokenizer-model {random} is not a SentencePiece model"),
    case("to-hf-tokenizer-model-without-type", "convert", "to-hf --load {ck} --save {new} --tokenizer-model {vocab}",
         "--tokenizer-model needs --tokenizer-type"),
    case("to-hf-iteration-missing", "convert", "to-hf --load {ck} --save {new} --iteration 7",
         "--iteration 7: --load {ck} holds no iter_0000007"),
    # ---- tools/convert_checkpoint.py from-hf -------------------------------------------------------------------
    case("from-hf-not-hf-folder", "convert", "from-hf --load {empty} --save {new}",
         "--load {empty}: no config.json there"),
    case("from-hf-malformed-config", "convert", "from-hf --load {hf_malformed} --save {new}",
         "{hf_malformed}/config.json is not valid JSON"),
    case("from-hf-no-weights", "convert", "from-hf --load {hf} --save {new}", "--load {hf}: no weights there"),
    case("from-hf-of-megalite-checkpoint", "convert", "from-hf --load {ck} --save {new}",
         "--load {ck} is a megalite checkpoint"),
    case("from-hf-existing-destination", "convert", "from-hf --load {hf} --save {ck_copy}",
         "--save {ck_copy} exists and is not empty", "--overwrite"),
    case("from-hf-tp-3", "convert", "from-hf --load {hf} --save {new} --tensor-model-parallel-size 3",
         "{hf}/config.json: this model cannot be cut into TP=3", "--tensor-model-parallel-size (3) must divide"),
    # ---- tools/generate.py ---------------------------------------------------------------------------------------
    case("generate-load-missing", "generate", "--load {d}/nope --prompt 1", f"--load {{d}}/nope: {NO_CKPT}"),
    case("generate-load-not-checkpoint", "generate", "--load {empty} --prompt 1", f"--load {{empty}}: {NO_CKPT}"),
    case("generate-load-other-model", "generate", f"{TOK} --hidden-size 64",
         "--load {ck}: the checkpoint's model differs", "--hidden-size: checkpoint 32, flags 64"),
    case("generate-top-p-2", "generate", f"{TOK} --top-p 2",
         "argument --top-p: must be a finite number in (0, 1], or 0", "got 2"),
    case("generate-temperature-negative", "generate", f"{TOK} --temperature -0.5",
         "argument --temperature: must be a finite number > 0 that fp32 holds (1.2e-38 to 3.4e38 in size), or 0 "
         "(0 is greedy), got -0.5"),
    case("generate-temperature-nan", "generate", f"{TOK} --temperature nan",
         "argument --temperature: must be a finite"),
    case("generate-top-k-negative", "generate", f"{TOK} --top-k -1", "argument --top-k: must be an integer in [1, "),
    case("generate-max-new-tokens-negative", "generate", "--load {ck} --prompt 1 --max-new-tokens -1",
         "argument --max-new-tokens: must be an integer in [1, ", "or 0 (0 generates nothing"),
    case("generate-past-positions", "generate", "--load {ck} --prompt 1 --max-new-tokens 40",
         "exceed the model's --max-position-embeddings (32)"),
    case("generate-prompts-file-not-utf8", "generate", "--load {ck} --prompts-file {latin1}",
         f"--prompts-file {{latin1}}, line 2: {NOT_UTF8}"),
    case("generate-prompt-not-ids", "generate", "--load {ck} --prompt hello", "--prompt 'hello': NullTokenizer reads"),
    case("generate-prompt-id-past-vocab", "generate", "--load {ck} --prompt 500 --max-new-tokens 2",
         "--prompt '500': token id 500 is outside the model's vocabulary [0, 129)"),
    case("generate-vocab-is-merges", "generate", f"{TOK} {BPE} --vocab-file {{merges}} --merge-file {{merges}}",
         "--vocab-file {merges} is not a GPT-2 vocab.json", SWAPPED),
    case("generate-context-parallel", "generate", f"{TOK} --context-parallel-size 2",
         f"--context-parallel-size 2: {NOT_CP}"),
    case("generate-output-json-dir-missing", "generate", f"{TOK} --output-json {{d}}/nodir/out.json",
         "--output-json {d}/nodir/out.json: directory {d}/nodir does not exist"),
    # ---- tasks/main.py -------------------------------------------------------------------------------------------
    case("tasks-wikitext-not-utf8", "tasks", f"{WIKI} --valid-data {{latin1}}",
         f"--valid-data {{latin1}}, line 2: {NOT_UTF8}"),
    case("tasks-lambada-not-utf8", "tasks", "--task LAMBADA --load {ck} --valid-data {latin1}",
         f"--valid-data {{latin1}}, line 2: {NOT_UTF8}"),
    case("tasks-valid-data-missing", "tasks", f"{WIKI} --valid-data {{d}}/nope.txt",
         "--valid-data {d}/nope.txt: no such file"),
    case("tasks-valid-data-is-folder", "tasks", f"{WIKI} --valid-data {{empty}}",
         "--valid-data {empty} is a directory"),
    case("tasks-lambada-not-json", "tasks", "--task LAMBADA --load {ck} --valid-data {text}",
         "{text}:1: expected a JSON object with a 'text' field"),
    case("tasks-words-for-null-tokenizer", "tasks", f"{WIKI} --valid-data {{text}}",
         "--valid-data {text}: NullTokenizer reads whitespace-separated integer token ids"),
    case("tasks-id-past-vocab", "tasks", f"{WIKI} --valid-data {{big_ids}}",
         "--valid-data {big_ids}: token id 400 is outside the model's vocabulary [0, 129)"),
    case("tasks-load-missing", "tasks", "--task WIKITEXT103 --overlapping-eval 8 --load {d}/nope --valid-data {ids}",
         f"--load {{d}}/nope: {NO_CKPT}"),
    case("tasks-load-is-file", "tasks", "--task WIKITEXT103 --overlapping-eval 8 --load {ids} --valid-data {ids}",
         f"--load {{ids}}: {NO_CKPT}"),
    case("tasks-load-other-model", "tasks", f"{WIKI} --valid-data {{ids}} --num-attention-heads 2",
         "--load {ck}: the checkpoint's model differs", "--num-attention-heads: checkpoint 4, flags 2"),
    case("tasks-not-sentencepiece", "tasks",
         f"{WIKI} --valid-data {{ids}} --tokenizer-type SentencePieceTokenizer --tokenizer-model {{random}}",
         "--tokenizer-model {random} is not a SentencePiece model"),
    case("tasks-context-parallel", "tasks", f"{WIKI} --valid-data {{ids}} --context-parallel-size 2",
         f"--context-parallel-size 2: {NOT_CP}"),
    case("tasks-overlapping-eval-0", "tasks", "--task WIKITEXT103 --overlapping-eval 0 --load {ck} --valid-data {ids}",
         "argument --overlapping-eval: must be an integer in [1, ", "got 0"),
    case("tasks-results-json-dir-missing", "tasks", f"{WIKI} --valid-data {{ids}} --results-json {{d}}/nodir/r.json",
         "--results-json {d}/nodir/r.json: directory {d}/nodir does not exist"),
    # ---- duplicate keys, files checked before use, messages naming what was written (issue 25) -------------------
    case("pretrain-config-duplicate-key", "pretrain", f"{TINY} --mock-data {NULL} --config {{dup_yaml}}",
         "--config: {dup_yaml}: key 'model.hidden_size' is written twice (lines 2 and 3)"),
    case("pretrain-config-two-spellings", "pretrain", f"{TINY} --mock-data {NULL} --config {{spellings_yaml}}",
         "--config: {spellings_yaml}: seed is given twice: 'seed' (line 1) and 'training.seed' (line 3)"),
    case("pretrain-config-is-directory", "pretrain", f"{TINY} --mock-data {NULL} --config {{empty}}",
         "--config: {empty} is a directory, not a file"),
    case("pretrain-deepspeed-duplicate-key", "pretrain", f"{TINY} --mock-data {NULL} --deepspeed-config {{dup_ds}}",
         "--deepspeed-config {dup_ds}: key 'gradient_clipping' is written twice (lines 2 and 3)"),
    case("pretrain-idx-of-other-dtype", "pretrain", f"{TINY} --split 1,0,0 --data-path {{mixed}} {NULL}",
         "the index {mixed}.idx says int32 tokens", "different token dtypes"),
    case("from-hf-duplicate-key", "convert", "from-hf --load {hf_dup} --save {new}",
         "{hf_dup}/config.json: key 'n_layer' is written twice (lines 2 and 3)"),
    case("generate-prompts-file-empty", "generate", "--load {ck} --prompts-file {blank}",
         "--prompts-file {blank} is empty"),
    case("tasks-lambada-text-number", "tasks", "--task LAMBADA --load {ck} --valid-data {lambada_number}",
         "{lambada_number}:2: 'text' must be a non-empty string, got int '7'"),
    # ---- checkpoint files checked before use: the tracker's text, metadata.json's shape -------------------------
    case("pretrain-load-unicode-digit-tracker", "pretrain", f"{TINY} --mock-data {NULL} --load {{ck_tracker}}",
         "--load {ck_tracker}: {ck_tracker}/latest_checkpointed_iteration.txt holds '١': not ASCII digits"),
    case("generate-load-unicode-digit-tracker", "generate", "--load {ck_tracker} --prompt 1",
         "latest_checkpointed_iteration.txt holds '١': not ASCII digits"),
    case("reshard-metadata-wrong-type", "convert", "reshard --load {ck_meta} --save {new}",
         "{ck_meta}/iter_0000001/metadata.json: layout.tp is '1', expected an integer >= 1"),
    case("tasks-metadata-wrong-type", "tasks", "--task WIKITEXT103 --overlapping-eval 8 --load {ck_meta} "
         "--valid-data {ids}", "{ck_meta}/iter_0000001/metadata.json: layout.tp is '1'"),
    # ---- numbers outside their declared domain (issue 25, classes 1 and 3) ------------------------------------
    case("pretrain-clip-grad-nan", "pretrain", f"{TINY} --mock-data {NULL} --clip-grad nan",
         "--clip-grad must be a finite number > 0, or 0 (0 disables clipping), got nan"),
    case("pretrain-exit-interval-negative", "pretrain", f"{TINY} --mock-data {NULL} --exit-interval -1",
         "--exit-interval must be an integer in [1, "),
    case("pretrain-moe-no-moe-layer", "pretrain", f"{TINY} --mock-data {NULL} {MOE} --moe-layer-freq [0,0]",
         "--moe-layer-freq '[0,0]' makes none of the 2 layers (--num-layers) an MoE layer"),
]

# The same fixtures with valid flags: these must succeed (the refusals above are about the flag under test).
CONTROLS = [
    case("ok-preprocess-bpe", "preprocess",
         f"--input {{jsonl}} --output-prefix {{new}} {BPE} --vocab-file {{vocab}} --merge-file {{merges}}"),
    case("ok-pretrain-data", "pretrain", f"{DATA} {NULL}"),
    case("ok-generate", "generate", "--load {ck} --prompt 1 --max-new-tokens 2 --greedy"),
    case("ok-tasks", "tasks", f"{WIKI} --valid-data {{ids}}"),
    case("ok-to-hf-tokenizer-flags", "convert",
         f"to-hf --load {{ck}} --save {{new}} {BPE} --vocab-file {{vocab}} --merge-file {{merges}}"),
]
PROTECTED = ("ck", "ck_copy")  # checkpoints that must come out of every case byte-identical


# ---- the server: one process, one fork per case ----------------------------------------------------------------


def _load_mains() -> dict:
    mains = {}
    for key, rel in ENTRY.items():
        spec = importlib.util.spec_from_file_location(f"entry_{key}", ROOT / rel)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mains[key] = mod.main
    return mains


def _child(main, script: str, argv: list[str], out: str, err: str) -> None:
    """In the forked child: what ``python script argv`` does after its imports; never returns."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        sys.argv = [script, *argv]
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_forked(main, script: str, argv: list[str], out: str, err: str) -> int | str:
    pid = os.fork()
    if pid == 0:
        _child(main, script, argv, out, err)
    deadline = time.monotonic() + CASE_TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hang"


def _run_exec(script: str, argv: list[str], out: str, err: str) -> int | str:
    with open(out, "w") as fo, open(err, "w") as fe:
        try:
            return subprocess.run([sys.executable, script, *argv], stdout=fo, stderr=fe, cwd=ROOT,
                                  timeout=CASE_TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            return "hang"


def serve(spec_path: str, result_path: str) -> None:
    """Run every case of the spec file; write {id: {rc, stdout, stderr, changed, created, seconds}}."""
    spec = json.load(open(spec_path))
    use_exec = os.environ.get("MEGALITE_BAD_INPUTS_EXEC") == "1"
    mains = {} if use_exec else _load_mains()
    if not use_exec:
        import transformers  # noqa: F401 - imported once here instead of in every child that reads HF files
    results = {}
    scratch = tempfile.mkdtemp(prefix="bad-inputs-")
    for c in spec["cases"]:
        script = str(ROOT / ENTRY[c["entry"]])
        before = {p: tree_hash(p) for p in spec["protected"]}
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        start = time.perf_counter()
        rc = (_run_exec(script, c["argv"], out, err) if use_exec
              else _run_forked(mains[c["entry"]], script, c["argv"], out, err))
        results[c["id"]] = {
            "rc": rc, "stdout": open(out, errors="replace").read(), "stderr": open(err, errors="replace").read(),
            "changed": [p for p in spec["protected"] if tree_hash(p) != before[p]],
            "created": sorted(p for p in os.listdir(os.path.dirname(c["new"]))
                              if p.startswith(os.path.basename(c["new"]))),
            "seconds": time.perf_counter() - start}
    shutil.rmtree(scratch, ignore_errors=True)
    json.dump(results, open(result_path, "w"))


# ---- the tests --------------------------------------------------------------------------------------------------


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character table (256 entries), for a minimal valid vocab.json."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    """The files the cases point at: one tiny checkpoint (and a copy as an existing destination), a
    .bin/.idx dataset, a valid GPT-2 vocab/merges pair, and files that are the wrong thing."""
    d = tmp_path_factory.mktemp("bad_inputs")
    p = {k: str(d / name) for k, name in [
        ("ck", "ck"), ("ck_copy", "ck_copy"), ("data", "data"), ("corrupt", "corrupt"), ("vocab", "vocab.json"),
        ("merges", "merges.txt"), ("random", "random.bin"), ("empty", "empty"), ("hf", "hf"),
        ("hf_malformed", "hf_malformed"), ("jsonl", "docs.jsonl"), ("text", "notes.txt"), ("words", "words.jsonl"),
        ("latin1", "latin1.txt"), ("ids", "ids.txt"), ("big_ids", "big_ids.txt"), ("out", "out")]}
    p["d"] = str(d)
    proc = launch_pretrain([*TINY.split(), "--mock-data", *NULL.split(), "--save", p["ck"]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(p["ck"], p["ck_copy"])
    for k in ("ck_tracker", "ck_meta"):  # a tracker of a Unicode digit (int() takes it), metadata of a wrong type
        p[k] = str(d / k)
        shutil.copytree(p["ck"], p[k])
    Path(p["ck_tracker"], "latest_checkpointed_iteration.txt").write_text("١")
    meta_path = Path(p["ck_meta"], "iter_0000001", "metadata.json")
    meta_path.write_text(meta_path.read_text().replace('"tp": 1,', '"tp": "1",', 1))
    random_indexed(p["data"], 30, seed=0, max_len=30, vocab=100)
    random_indexed(p["corrupt"], 5, seed=1)
    with open(p["corrupt"] + ".idx", "r+b") as f:
        f.write(b"not an index")
    vocab = {c: i for i, c in enumerate(_byte_level_chars())}
    vocab.update({"Ġt": 256, "<|endoftext|>": 257})
    Path(p["vocab"]).write_text(json.dumps(vocab))
    Path(p["merges"]).write_text("#version: 0.2\nĠ t\n")
    Path(p["random"]).write_bytes(bytes(range(256)) * 2)
    for k in ("empty", "hf", "hf_malformed", "out"):
        os.makedirs(p[k])
    Path(p["hf"], "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 32, "n_head": 4,
        "vocab_size": 128, "n_positions": 32, "activation_function": "gelu"}))
    Path(p["hf_malformed"], "config.json").write_text('{"model_type": "gpt2",\n "n_layer": }\n')
    Path(p["jsonl"]).write_text('{"text": "1 2 3"}\n{"text": "Ġt t"}\n')
    Path(p["text"]).write_text("hello world, this is text\n")
    Path(p["words"]).write_text('{"text": "hello world"}\n')
    Path(p["latin1"]).write_bytes(b'{"text": "1 2"}\n{"text": "caf\xe9"}\n')
    Path(p["ids"]).write_text("1 2 3 4 5 6 7 8 9 10\n" * 5)
    Path(p["big_ids"]).write_text("1 2 3 400 5 6\n" * 5)
    for k, name, text in [  # issue 25: duplicate keys, files of the wrong shape
            ("dup_yaml", "dup.yaml", "model:\n  hidden_size: 32\n  hidden_size: 64\n"),
            ("spellings_yaml", "spellings.yaml", "seed: 1\ntraining:\n  seed: 2\n"),
            ("dup_ds", "dup_ds.json", '{"train_micro_batch_size_per_gpu": 2,\n "gradient_clipping": 1.0,\n'
                                      ' "gradient_clipping": 0.0}\n'),
            ("blank", "blank.txt", "\n\n"),
            ("lambada_number", "lambada.jsonl", '{"text": "1 2 3"}\n{"text": 7}\n')]:
        p[k] = str(d / name)
        Path(p[k]).write_text(text)
    p["mixed"], p["hf_dup"] = str(d / "mixed"), str(d / "hf_dup")
    random_indexed(p["mixed"], 5, seed=2, vocab=100)
    random_indexed(str(d / "mixed_i32"), 5, seed=2, vocab=100, dtype=np.int32)
    shutil.copy(str(d / "mixed_i32.idx"), p["mixed"] + ".idx")
    os.makedirs(p["hf_dup"])
    Path(p["hf_dup"], "config.json").write_text('{"model_type": "gpt2",\n "n_layer": 2,\n "n_layer": 4}\n')
    return p


def _fill(text: str, p: dict, new: str) -> str:
    return text.format(**p, new=new)


@pytest.fixture(scope="module")
def results(paths, tmp_path_factory) -> dict:
    """Every case and control, run once by the server process."""
    spec = {"protected": [paths[k] for k in PROTECTED], "cases": []}
    for c in CASES + CONTROLS:
        new = os.path.join(paths["out"], c.id)
        spec["cases"].append({"id": c.id, "entry": c.entry, "new": new,
                              "argv": [_fill(a, paths, new) for a in c.argv]})
    d = tmp_path_factory.mktemp("server")
    spec_path, result_path = str(d / "spec.json"), str(d / "results.json")
    json.dump(spec, open(spec_path, "w"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, spec_path, result_path], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=CASE_TIMEOUT * 4 + 5 * len(spec["cases"]))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.load(open(result_path))


def test_every_entry_point_has_at_least_five_cases():
    counts = {e: sum(c.entry == e for c in CASES) for e in ENTRY}
    per_command = {cmd: sum(c.argv[0] == cmd for c in CASES if c.entry == "convert")
                   for cmd in ("reshard", "to-hf", "from-hf")}
    assert min(counts.values()) >= 5 and min(per_command.values()) >= 5 and len(CASES) >= 40, (counts, per_command)
    assert len({c.id for c in CASES + CONTROLS}) == len(CASES + CONTROLS)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_by_name(results, paths, c):
    r = results[c.id]
    assert r["rc"] != "hang", f"{c.id} ran past {CASE_TIMEOUT} s"
    proc = subprocess.CompletedProcess(c.argv, r["rc"], r["stdout"], r["stderr"])
    refused(proc)
    assert "error" in r["stderr"], r["stderr"][-3000:]
    for text in c.expected:
        text = _fill(text, paths, os.path.join(paths["out"], c.id))
        assert text in r["stderr"], f"{text!r} not in stderr:\n{r['stderr'][-3000:]}"
    assert r["changed"] == [], f"{c.id} changed {r['changed']}"
    assert r["created"] == [], f"{c.id} left {r['created']} at its output"


@pytest.mark.parametrize("c", CONTROLS, ids=[c.id for c in CONTROLS])
def test_the_same_fixtures_with_valid_flags_succeed(results, c):
    r = results[c.id]
    assert r["rc"] == 0, r["stderr"][-3000:]
    assert r["changed"] == [], f"{c.id} changed {r['changed']}"


def test_output_prefix_in_a_read_only_directory_is_found_before_tokenizing(paths, monkeypatch, capsys):
    """Tests run as root (a chmod does not stop root), so the start-up probe's write fails by patching."""
    import errno

    from megalite.data import preprocess as engine

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(engine.tempfile, "NamedTemporaryFile", read_only)
    prefix = os.path.join(paths["out"], "read_only")
    rc = load_tool("preprocess_data").main(["--input", paths["jsonl"], "--output-prefix", prefix, *NULL.split()])
    err = capsys.readouterr().err
    assert rc == 1 and f"--output-prefix {prefix}: cannot write in {paths['out']} (Read-only file system)" in err, err
    assert not [f for f in os.listdir(paths["out"]) if f.startswith("read_only")]


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
