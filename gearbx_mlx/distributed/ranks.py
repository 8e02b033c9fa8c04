"""The ranks of a sharded run: failing together, agreeing, sharing rank 0's choices.

Every rank of a tensor-parallel run must make the same collectives in the
same order; a rank that fails alone (a file missing on one Mac, another
model, a flag that does not apply) would leave the others waiting in the
next one, or fail them with a transport error that says nothing about the
cause. So the places where one rank can fail alone are *stages*: every rank
runs the stage's work, then the ranks exchange how it went, and if any rank
failed, every rank raises: the rank that failed its own error, the others a
:class:`RankError` that names that rank and repeats its message. A single
``error:`` line on every rank, and no rank left waiting.

The same exchange (:meth:`Ranks.gather`: two small ``all_sum`` collectives of
bytes) checks that the ranks agree on what must be equal (:meth:`Ranks.check_same`:
the model, the settings, the thresholds, the prompt) and hands rank 0's
choice of something measured to all (:meth:`Ranks.first`: a calibration, the
decision to draft). Nothing here is a transport of its own: it is
``mx.distributed`` on whatever backend ``mlx.launch`` chose.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import socket
from typing import Any, ContextManager, Dict, Iterator, List, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream

from .exchange import StepExchange
from .layers import group_of, sharded_paths

#: Longest error message carried to the other ranks (bytes of UTF-8).
MESSAGE_BYTES = 600
#: Exceptions a peer's failure is re-raised as (by the failing rank's type name); others: RankError.
_KINDS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError}


class RankError(RuntimeError):
    """Another rank failed (its rank and message are in this one's)."""


def launched_group() -> Optional[Any]:
    """``mx.distributed.init()``'s group when this process is one of several (``mlx.launch``), else None."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def launched_ranks() -> Optional["Ranks"]:
    """:class:`Ranks` of the processes ``mlx.launch`` started, or None for a process on its own."""
    group = launched_group()
    return Ranks(group) if group is not None else None


def stage(ranks: Optional["Ranks"], doing: str) -> ContextManager[None]:
    """:meth:`Ranks.stage`, or nothing special for one process (``ranks`` None)."""
    return ranks.stage(doing) if ranks is not None else contextlib.nullcontext()


class Ranks:
    """This process among the ranks of a group.

    Args:
        group: an ``mx.distributed`` group of more than one process.

    Attributes:
        rank, size: this process's rank and the group's size.
        exchange: the per-step :class:`~gearbx_mlx.distributed.exchange.StepExchange`.
            Set it to None and every rank decides on its own logits, with no
            collective of its own: valid only where the ranks' logits are bit
            for bit the same (a trace's ``ranks_agree`` shows whether they
            were); the benchmark uses it to measure what the exchange costs.
        identity: the model's identity for :meth:`check_same` (set by whoever
            knows the model: :func:`model_identity`).
    """

    def __init__(self, group: Any) -> None:
        if group.size() < 2:
            raise ValueError("Ranks needs a group of two or more processes")
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.exchange = StepExchange(group)
        self.identity: Optional[str] = None

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["Ranks"]:
        """The ranks a model is sharded over (None for a model on one process)."""
        group = group_of(model)
        return cls(group) if group is not None else None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, size={self.size})"

    # -- the byte exchange ---------------------------------------------------------
    def gather(self, data: bytes) -> List[bytes]:
        """Every rank's ``data``, on every rank (two ``all_sum`` collectives: lengths, then bytes).

        Issued on mlx-lm's generation stream: a decode loop leaves its last
        step (with the model's collectives) running there, and collectives
        must run in one order on every rank.
        """
        mine = np.zeros(self.size, np.uint32)
        mine[self.rank] = len(data)
        with mx.stream(generation_stream):
            lengths = np.asarray(mx.distributed.all_sum(mx.array(mine), group=self.group)).tolist()
            width = max(max(lengths), 1)
            table = np.zeros((self.size, width), np.uint8)
            table[self.rank, : len(data)] = np.frombuffer(data, np.uint8)
            total = np.asarray(mx.distributed.all_sum(mx.array(table), group=self.group))
        return [total[r, :n].tobytes() for r, n in enumerate(lengths)]

    def gather_json(self, obj: Any) -> List[Any]:
        return [json.loads(b.decode()) for b in self.gather(json.dumps(obj, sort_keys=True).encode())]

    # -- failing together ------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, doing: str) -> Iterator[None]:
        """Run a stage of work that may fail on one rank alone; fail on all if any failed.

        Args:
            doing: what the stage does, for the message ("loading the model").

        Raises:
            the rank's own exception where it failed; elsewhere the failing
            rank's ``ValueError``/``FileNotFoundError``/``TypeError`` (or a
            :class:`RankError`) naming it.
        """
        error: Optional[BaseException] = None
        try:
            yield
        except Exception as e:  # noqa: BLE001  (any failure must reach the other ranks)
            error = e
        text = " ".join(str(error).split()) if error is not None else ""
        report = {"failed": error is not None, "type": type(error).__name__ if error else "",
                  "message": text.encode()[:MESSAGE_BYTES].decode(errors="ignore")}
        reports = self.gather_json(report)
        if error is not None:
            raise error
        failed = [(r, rep) for r, rep in enumerate(reports) if rep["failed"]]
        if failed:
            r, rep = failed[0]
            kind = _KINDS.get(rep["type"], RankError)
            more = f" (and {len(failed) - 1} other rank{'s' if len(failed) > 2 else ''})" if len(failed) > 1 else ""
            raise kind(f"rank {r} of {self.size}{more} failed while {doing}: {rep['message'] or rep['type']}")

    # -- agreeing --------------------------------------------------------------------
    def check_same(self, facts: Mapping[str, str]) -> None:
        """Raise on every rank unless every rank has the same ``facts``.

        Args:
            facts: ``{what: value}``; long values are compared by digest.

        Raises:
            ValueError: naming the first fact the ranks disagree on and each
                rank's value (or digest).
        """
        short = {k: v if len(v) <= 48 else "digest " + hashlib.sha256(v.encode()).hexdigest()[:12]
                 for k, v in facts.items()}
        every = self.gather_json(short)
        for key in short:
            seen = [f.get(key) for f in every]
            if any(v != seen[0] for v in seen):
                per = "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
                raise ValueError(
                    f"the {self.size} ranks disagree on {key} ({per}): every rank must run the same model, "
                    "settings and prompt (the same files and flags on every machine)")

    def first(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (JSON-able) on every rank: for choices made from timings or other
        measurements that may differ between ranks."""
        return self.gather_json(obj)[0]


def model_identity(model: nn.Module) -> str:
    """A digest of what every rank must share: the architecture, its arguments, the
    shapes and dtypes of the rank's parameters, and the contents of every
    parameter that is not sharded (embedding, norms, head) by an exact integer
    checksum. Two ranks with different weights or configs differ here.

    Computed once per model, as it was first seen (a gearbox whose nested high
    gear reads the planes replaces the loaded layers with views of the rank's
    own planes, which are not the same on every rank).
    """
    known = getattr(model, "_gearbx_identity", None)
    if isinstance(known, str):
        return known
    digest = _identity(model)
    object.__setattr__(model, "_gearbx_identity", digest)
    return digest


def _identity(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    try:
        arg_text = json.dumps(vars(args), sort_keys=True, default=str) if args is not None else ""
    except TypeError:
        arg_text = repr(args)
    sharded = sharded_paths(model)
    params = tree_flatten(model.parameters())
    replicated = [v for k, v in params if not any(k.startswith(p + ".") for p in sharded)]
    sums = [mx.sum(_words_of(v)) for v in replicated]  # uint32 sums wrap: exact, order-free
    mx.eval(sums)
    h = hashlib.sha256()
    h.update(f"{type(model).__module__}.{type(model).__name__}\0{arg_text}\0".encode())
    for k, v in params:
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype}\0".encode())
    h.update(np.array([s.item() for s in sums], np.uint32).tobytes())
    return h.hexdigest()


def _words_of(x: mx.array) -> mx.array:
    """``x``'s bytes as uint32 words where they fit, else as bytes (values widened)."""
    flat = x.reshape(-1)
    if x.nbytes % 4 == 0 and x.dtype.size in (4, 8):
        return mx.view(flat, mx.uint32)
    if x.dtype.size == 2:
        return mx.view(flat, mx.uint16).astype(mx.uint32)
    return mx.view(flat, mx.uint8).astype(mx.uint32) if x.dtype != mx.bool_ else flat.astype(mx.uint32)


def facts_of(**values: Any) -> Dict[str, str]:
    """``{name: canonical text}`` of JSON-able values, for :meth:`Ranks.check_same`."""
    return {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str) for k, v in values.items()}


__all__ = ["MESSAGE_BYTES", "RankError", "Ranks", "facts_of", "launched_group", "launched_ranks", "model_identity",
           "stage"]


def free_port_base(n: int) -> int:
    """A port with its ``n - 1`` successors free on the loopback (a local
    ``mlx.launch --backend ring`` listens on them)."""
    for _ in range(50):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free loopback ports")
