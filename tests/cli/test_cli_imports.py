"""The ``mhe`` command answers at once (issue 45): its import graph, not a timing. Help, argument
and setting errors, ``mhe params``, ``mhe memory`` and ``mhe scaling`` import no torch (about 3 s of
start-up on 2 cores), nor transformers, matplotlib or the training engine; the torch-free tables
they use (:mod:`mhe.attention.options`) agree with the sublayers; a command that goes on to use
torch gets ``MHE_THREADS`` applied as torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
HEAVY = ("torch", "transformers", "matplotlib", "sympy", "mhe.tasks.registry", "mhe.training.loop")


def _imported(*argvs: list[str]) -> tuple[list[int], set[str]]:
    """(exit statuses, the HEAVY modules imported) of ``mhe ARGV`` for each ARGV, one after the
    other in one fresh interpreter."""
    code = ("import json, sys\nfrom mhe.cli import main\nrcs = []\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n        rcs.append(main(argv))\n    except SystemExit as e:\n        rcs.append(e.code)\n"
            f"print(json.dumps([rcs, [m for m in {HEAVY!r} if m in sys.modules]]))")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "MHE_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True, env=env,
                         timeout=120)
    rc, mods = json.loads(out.stdout.strip().splitlines()[-1])
    return rc, set(mods)


def test_help_and_argument_errors_import_no_torch():
    from mhe.cli import COMMANDS

    helps = [[name, "--help"] for name in COMMANDS]
    errors = [["no-such-command"], ["--bogus"], ["pretrain", "--bogus"], ["compare", "--seeds", "x"], ["convert"],
              ["generate", "--max-new-tokens", "many"], ["bench", "--train-batch"]]
    rcs, mods = _imported([], ["--help"], *helps, *errors)
    assert rcs == [0, 0] + [0] * len(helps) + [2] * len(errors) and mods == set()


def test_setting_errors_import_no_torch():
    recall = ["train", "--task", "recall", "--preset", "tiny-decoder", "--set"]
    rcs, mods = _imported(["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--set", "train.lr=abc"],
                          recall + ["train.nope=1"], recall + ["data.task_options.pairs=0"],
                          ["train-mt", "--set", "train.steps=-1"], ["pretrain", "--preset", "tiny-decoder", "--data", "x"],
                          ["finetune", "--task", "rte", "--run", "no-such-run"], ["run", "--config", "no.json", "--out", "x"])
    assert rcs == [2] * 7 and mods == set()


def test_argument_and_path_errors_that_need_no_model_import_no_torch(tmp_path):
    """Issue 58: a run that does not exist, generation options out of range, a missing checkpoint,
    a non-empty export folder and a gqa conversion whose K/V heads do not divide the source's (read
    from its config.json alone) are refused before torch is imported."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 4}')
    prompt = ["generate", "--run", str(tmp_path), "--prompt", "a"]
    rcs, mods = _imported(["eval", "--run", "no-such-run"], ["eval", "--checkpoint", "no-such-run"],
                          ["generate", "--run", "no-such-run", "--prompt", "a"],
                          [*prompt, "--max-new-tokens", "-1"], [*prompt, "--top-p", "1.5"],
                          [*prompt, "--temperature", "0"],
                          ["export", "--run", "no-such-run", "--out", str(tmp_path / "o")],
                          ["export", "--run", str(tmp_path), "--out", str(tmp_path / "full")],
                          ["convert", "--checkpoint", "no-such-run", "--attention", "mqa"],
                          ["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "gqa", "--n-kv-heads", "3"],
                          ["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "mqa", "--n-kv-heads", "2"],
                          ["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "gqa",
                           "--out", str(tmp_path / "full")])
    assert rcs == [2] * 12 and mods == set()


def test_threads_apply_when_a_command_imports_torch():
    """``MHE_THREADS`` reaches torch when the command first imports it (here ``mhe eval``, which stops
    at a missing run after loading its modules)."""
    code = ("import json, sys\nfrom mhe.cli import main\nrc = main(['eval', '--run', 'no-such-run'])\n"
            "import torch\nprint(json.dumps([rc, torch.get_num_threads()]))")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "MHE_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [2, 2]


def test_params_memory_and_scaling_import_no_torch():
    rcs, mods = _imported(["params", "--preset", "llama-135m"], ["memory", "--preset", "llama-135m"], ["scaling"],
                          ["params", "--layers", "-1", "--heads", "2", "--head-dim", "4"], ["memory", "--help"])
    assert rcs == [0, 0, 0, 2, 0] and mods == set()


@pytest.mark.parametrize("rotary", [False, True])
def test_the_torch_free_cache_heads_are_the_sublayers_own(rotary):
    """``spec.cache_heads`` (what ``mhe memory`` prints) equals every built sublayer's."""
    from mhe.attention import KINDS, build_attention
    from mhe.attention.spec import cache_heads, make_config
    from mhe.attention.rotary import RotaryEmbedding

    cases = [(k, {}) for k in KINDS if k not in ("fnet", "linear")] + [("gqa", {"n_kv_heads": 2})]
    cases += [(k, {"impl": impl, "rope_order": order}) for k in ("mhe-add", "mhe-mul") for impl in ("fast", "reference")
              for order in ("rope-then-psi", "psi-then-rope")]
    for kind, opts in cases:
        attn = build_attention(kind, d_model=32, n_heads=8, causal=True, **opts)
        if rotary:
            attn.attach_rotary(RotaryEmbedding(4, max_len=1))
        cfg = make_config(kind, d_model=32, n_heads=8, causal=True, **opts)
        assert cache_heads(kind, 8, cfg.options, rotary=rotary) == attn.cache_heads, (kind, opts)
    assert cache_heads("linear", 8, make_config("linear", d_model=32, n_heads=8).options) == 0


def test_the_constant_mark_is_dynamos_own():
    """``flash_decode.constant_result`` sets what ``torch.compiler.assume_constant_result`` sets."""
    import torch

    from mhe.attention.flash_decode import constant_result

    def ours():
        return 1

    def theirs():
        return 1

    torch.compiler.assume_constant_result(theirs)
    assert vars(constant_result(ours)) == vars(theirs) == {"_dynamo_marked_constant": True}
