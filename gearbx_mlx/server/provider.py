"""The model behind the server: mlx-lm's ``ModelProvider`` loading through the
package, and the one call into the package's generation (:func:`package_stream`).

The provider serves exactly one model, the one the flags name: its weights,
tokenizer and gearbox load once, in the generation thread, when the server
starts (requests sent meanwhile wait in the queue). A request naming another
model is refused with a 404.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from mlx_lm.server import ModelProvider

from ..config import GearboxConfig
from ..generation import GearboxResponse, context_length, load, warm_up
from ..pipeline import stream_generate
from ..speculative.cli import check_sparse_model, speculative_config
from ..speculative.decode import SpeculativeConfig, get_draft
from ..speculative.plan import SpeculativePlan
from ..speculative.sparse import AUTO
from ..thresholds import check_thresholds, set_thresholds

#: The model name every mlx-lm client may send for "the server's model".
DEFAULT_MODEL = "default_model"


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status it answers with."""

    status = 400


class ModelNotServed(RequestError):
    status = 404


def package_stream(model: Any, tokenizer: Any, prompt: List[int], gearbox: Any, *,
                   speculative: Optional[str] = None, config: Optional[SpeculativeConfig] = None,
                   **kwargs: Any) -> Iterator[GearboxResponse]:
    """Every call the server makes into the package's generation: the one pipeline's
    :func:`~gearbx_mlx.pipeline.stream_generate`.

    Args:
        speculative: None for routed decoding, else ``"auto"`` or ``"force"``
            with ``config`` (the loaded speculative settings).
        kwargs: the pipeline's keyword arguments.
    """
    if speculative is not None:
        kwargs["speculative"] = dataclasses.replace(config or SpeculativeConfig(), mode=speculative)
    return stream_generate(model, tokenizer, prompt, gearbox, **kwargs)


class GearModelProvider(ModelProvider):
    """mlx-lm's model provider, loading the model and its gearbox with :func:`gearbx_mlx.load`.

    Args:
        cli_args: the parsed flags (already checked).
        config: the gearbox settings the flags give.
    """

    def __init__(self, cli_args: argparse.Namespace, config: GearboxConfig) -> None:
        super().__init__(cli_args)
        self.config = config
        self.gearbox: Any = None
        self.draft: Any = None
        self.speculative: Any = None  # the SpeculativeConfig of a server started with --speculative
        self.plans: Dict[Tuple[str, bool], SpeculativePlan] = {}
        self.loaded = threading.Event()
        #: what stopped the model from loading (the server then exits with it)
        self.load_error: Optional[BaseException] = None
        self.names = {DEFAULT_MODEL} | ({cli_args.model} if cli_args.model else set())

    @property
    def model_id(self) -> str:
        """The name ``/v1/models`` lists."""
        if self.gearbox is not None:
            return self.gearbox.model_name
        return self.cli_args.model or DEFAULT_MODEL

    @property
    def context_length(self) -> Optional[int]:
        """The model's context (``max_position_embeddings``), if its config says."""
        return context_length(self.model)

    def load_default(self) -> None:
        """Load the served model now (mlx-lm's waits for a first request when no ``--model`` is given)."""
        self.load(DEFAULT_MODEL)

    def load(self, model_path: str, adapter_path: Optional[str] = None,
             draft_model_path: Optional[str] = None) -> Tuple[Any, Any]:
        """The served model; loads it on the first call.

        Raises:
            ModelNotServed: ``model_path`` names another model.
            RequestError: an adapter or a draft model is asked for.
        """
        if adapter_path is not None:
            raise RequestError("adapters are not supported: the gears are built from the loaded weights")
        if draft_model_path not in (None, DEFAULT_MODEL):
            raise RequestError("draft_model is not supported: speculative decoding drafts with a lower gear of the "
                               "model itself (see gearbx.speculative)")
        if model_path not in self.names and (self.gearbox is None or model_path != self.gearbox.model_name):
            raise ModelNotServed(f"model {model_path!r} is not served here: this server serves {self.model_id!r}")
        if self.model is None:
            self._load_gears()
        return self.model, self.tokenizer

    def _load_gears(self) -> None:
        args = self.cli_args
        model, tokenizer, gearbox = load(args.model, config=self.config, dtype=args.dtype,
                                         tokenizer_config=self._tokenizer_config,
                                         draft_scope=args.draft_scope if args.speculative else None)
        warm_up(model)  # the first request then reuses MLX's buffers, as the generate command's prompt does
        # The generate CLI's own steps: thresholds from the flags, a file or a (cached) calibration.
        set_thresholds(args, model, tokenizer, gearbox, None)
        check_thresholds(gearbox)
        if args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        if args.speculative:
            check_sparse_model(args, model)
            self.speculative = spec = speculative_config(args, gearbox)
            # draft_sparsity "auto": the first request's decision builds the drafter it chooses
            self.draft = None if spec.draft_sparsity == AUTO else get_draft(
                model, gearbox, args.draft_gear, args.draft_scope, spec.draft_sparsity, tokenizer, spec.sparse_options)
        self.model_key = ("gearbx", str(args.model), str(Path(gearbox.model_name)))
        self.model, self.tokenizer, self.gearbox = model, tokenizer, gearbox
        self.processor = None
        self.is_batchable = False
        self.loaded.set()

    def plan_for(self, mode: str, greedy: bool) -> Optional[SpeculativePlan]:
        """The decision an earlier request of this mode measured, reused (None before the first)."""
        return self.plans.get((mode, greedy))

    def keep_plan(self, mode: str, greedy: bool, plan: Optional[Dict[str, Any]]) -> None:
        if plan is not None and (mode, greedy) not in self.plans:
            self.plans[(mode, greedy)] = SpeculativePlan(**plan)
