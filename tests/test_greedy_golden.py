"""Greedy outputs of every generation mode on the default model, held to a committed record.

``tests/data/greedy_golden.json`` was written by running this file as a script
(``python tests/test_greedy_golden.py --write``) on the code before the routed and
speculative pipelines became one; the test runs the same cases through today's
pipeline and requires the same token ids. A change that moves any mode's greedy
output fails here, and a deliberate one rewrites the record in its own commit.

Float32 sums in another order can flip a near-tie of the argmax, and MLX's
CPU products sum in the order of the BLAS they run on: the record holds the
outputs with an optimized BLAS (OpenBLAS preloaded, as ``.ci/run`` and the
command lines do) under ``cases`` and with the reference BLAS that MLX's Linux
wheel links under ``reference_blas_cases`` (written by ``--write`` without the
preload, from the same code), and the test compares with the one this
process runs on. OpenBLAS picks its kernels by CPU (``openblas_get_corename``),
and their sums differ in order too: ``cases`` was recorded on an AMD EPYC,
``optimized_blas_kernels`` holds the outputs on other CPUs, named by their
OpenBLAS kernels and the package's C kernels (``--write-kernel``, from the same
code), and with an optimized BLAS an output must equal one of them. One
OpenBLAS thread (pytest's parallel workers run it so: ``conftest.py``) sums in
another order than two on some CPUs; such outputs are kept under the kernel's
name with ", 1 thread". The reference BLAS gave the same outputs on an Intel
Xeon as on the AMD EPYC.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

GOLDEN = Path(__file__).parent / "data" / "greedy_golden.json"
PROMPTS = ("Write two sentences about the moon.", "List three uses of a paperclip:")
#: Tokens the record holds per prompt.
TOKENS = 20
#: Tokens the test generates and compares: the record's first ones (greedy decoding is
#: a prefix of itself). 15 tell every two different recorded outputs apart (the
#: static mid and high gears part at the 15th token of these prompts;
#: ``test_the_record_covers_every_case_and_differs_between_gears`` checks it). The
#: speculative cases must equal the high gear's output: 8 tokens of the first prompt
#: take them through several drafted blocks, each run timing its gears first.
CHECKED = 15
CHECKED_SPECULATIVE = 8


def checked(name: str, outputs: List[List[int]]) -> List[List[int]]:
    """The part of a case's per-prompt outputs that the test compares."""
    if name.startswith("speculative"):
        return [ids[:CHECKED_SPECULATIVE] for ids in outputs[:1]]
    return [ids[:CHECKED] for ids in outputs]

#: name -> (load options, generation options). Every routed case names its kernel,
#: so that a change of the default kernel cannot hide behind the record.
CASES: Dict[str, Any] = {
    "routed-entropy-attention": ({"scope": "attention", "kernel": "packed"}, {}),
    "routed-entropy-all": ({"scope": "all", "kernel": "packed"}, {}),
    "routed-entropy-all-separate": ({"scope": "all", "kernel": "packed", "store": "separate"}, {}),
    "routed-entropy-all-mlx": ({"scope": "all", "kernel": "mlx"}, {}),
    "static-low-all": ({"scope": "all", "kernel": "packed", "static_gear": "low"}, {}),
    "static-mid-all": ({"scope": "all", "kernel": "packed", "static_gear": "mid"}, {}),
    "static-high-all": ({"scope": "all", "kernel": "packed", "static_gear": "high"}, {}),
    "routed-kv4-rotated": ({"scope": "all", "kernel": "packed", "static_gear": "high"},
                           {"kv_bits": 4, "quantized_kv_start": 0}),
    "speculative-force": ({"scope": "all", "kernel": "packed"}, {"speculative": "force", "max_draft": 3}),
    "speculative-fixed": ({"scope": "all", "kernel": "packed"}, {"speculative": None, "max_draft": 2}),
    "speculative-plain": ({"scope": "all", "kernel": "packed"}, {"speculative": "plain"}),
}


def run_case(load_options: Dict[str, Any], options: Dict[str, Any], tokens: int = TOKENS,
             prompts: int = len(PROMPTS)) -> List[List[int]]:
    """Greedy token ids of the first ``prompts`` prompts (``tokens`` each at most), through the
    package's public API."""
    import gearbx_mlx
    from gearbx_mlx.chat import apply_chat_template

    model, tok, gearbox = gearbx_mlx.load(**load_options)
    options = dict(options)
    out = []
    for prompt in PROMPTS[:prompts]:
        text = apply_chat_template(tok, prompt, None, use_template=True)
        if "speculative" in options:
            opts = dict(options)
            mode = opts.pop("speculative")
            stream = gearbx_mlx.stream_speculative_generate(
                model, tok, text, gearbox, max_tokens=tokens,
                **({"plain": True} if mode == "plain" else {"mode": mode} if mode else {}), **opts)
        else:
            stream = gearbx_mlx.stream_generate(model, tok, text, gearbox, max_tokens=tokens, **options)
        out.append([int(r.token) for r in stream])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_output_matches_the_record(name):
    from gearbx_mlx.blas import optimized

    record = json.loads(GOLDEN.read_text())
    golden = record[record_key(optimized())]
    assert name in golden, f"{name} has no record: rewrite {GOLDEN.name} with --write"
    accepted = [golden[name]]
    if optimized():
        accepted += [cases[name] for cases in record.get("optimized_blas_kernels", {}).values() if name in cases]
    accepted = [checked(name, outputs) for outputs in accepted]
    got = run_case(*CASES[name], tokens=len(accepted[0][0]), prompts=len(accepted[0]))
    assert got in accepted, f"{name}: {got} is none of the {len(accepted)} recorded outputs (BLAS kernels: " \
                            f"{blas_kernel()})"


def blas_kernel() -> str:
    """OpenBLAS's kernel family for this CPU (``openblas_get_corename``; else what runs the products),
    and the instruction sets of the package's C kernels."""
    import ctypes

    from gearbx_mlx.bindings import cpu
    from gearbx_mlx.blas import optimized

    info = cpu.info()
    c = f"C kernels {info['float_isa']}/{info['intdot_isa']}" if info["available"] else "no C kernels"
    try:
        name = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return f"{'optimized' if optimized() else 'reference'} BLAS, {c}"
    name.restype = ctypes.c_char_p
    threads = getattr(ctypes.CDLL(None), "openblas_get_num_threads", lambda: 0)()
    return f"OpenBLAS {name().decode()}, {c}" + (", 1 thread" if threads == 1 else "")


def record_key(optimized_blas: bool) -> str:
    """The record of outputs with an optimized BLAS, or with MLX's reference one."""
    return "cases" if optimized_blas else "reference_blas_cases"


def _records():
    record = json.loads(GOLDEN.read_text())
    return {"cases": record["cases"], "reference_blas_cases": record["reference_blas_cases"],
            **{f"kernel {k}": v for k, v in record.get("optimized_blas_kernels", {}).items()}}


@pytest.mark.parametrize("key", sorted(_records()))
def test_the_record_covers_every_case_and_differs_between_gears(key):
    golden = _records()[key]
    assert set(golden) == set(CASES)
    # The record can tell the gears apart: a record of one output for all would hold for anything;
    # and so can the part of it the test compares, for every two cases whose outputs differ.
    assert golden["static-low-all"] != golden["static-high-all"]
    for a in CASES:
        for b in CASES:
            if golden[a] != golden[b] and not (a.startswith("speculative") or b.startswith("speculative")):
                assert checked(a, golden[a]) != checked(b, golden[b]), (a, b)
    # Exact speculative decoding is the high gear's output, whatever drafts.
    for name in ("speculative-force", "speculative-fixed", "speculative-plain"):
        assert golden[name] == golden["static-high-all"], name


if __name__ == "__main__" and "--write-kernel" in sys.argv:
    # Adds the outputs of this CPU's OpenBLAS kernels beside the record (OpenBLAS preloaded).
    from gearbx_mlx.blas import optimized

    assert optimized(), "run with an optimized BLAS (LD_PRELOAD=... libopenblas.so.0)"
    record = json.loads(GOLDEN.read_text())
    record.setdefault("optimized_blas_kernels", {})[blas_kernel()] = {n: run_case(*c) for n, c in CASES.items()}
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote the outputs of {blas_kernel()} into {GOLDEN}")
elif __name__ == "__main__" and "--write" in sys.argv:
    # Writes the record of the BLAS this process runs on; the other one is kept.
    from gearbx_mlx.blas import optimized

    GOLDEN.parent.mkdir(exist_ok=True)
    record = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    record.update({"prompts": PROMPTS, "tokens": TOKENS,
                   record_key(optimized()): {n: run_case(*c) for n, c in CASES.items()}})
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {record_key(optimized())} of {GOLDEN}")
