"""`DraftHead`: what a kind of drafter declares about itself, in one place.

The backbone asks a head, and nothing else, about its kind: no module outside train/heads/
compares `drafter_type` with a name (tests/test_heads.py scans for it). Every method has a
default that adds nothing, which is the plain DFlash drafter (heads/dflash.py); DFlash2
(heads/dflash2.py) overrides most of them. Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from dflash.runtime.errors import InputError, SettingError

if TYPE_CHECKING:
    import torch
    from torch import nn

# The drafter (train/model/drafter.py), its DrafterConfig (train/model/drafter_config.py) and the objective's
# settings (train/config.py) import this package: named here without importing them back.
DFlashDrafter = Any
DrafterConfig = Any
ObjectiveConfig = Any


class HeadSettingError(SettingError):
    """A head's setting it cannot build a drafter with (out of range, or not fitting the target's
    dimensions): a usage error naming the flag, and a ValueError, as DrafterConfig's own refusals."""


class HeadExportError(InputError, ValueError):
    """An export's config.json declares a layout of the head this trainer cannot read or decode."""


@dataclass
class HeadInputs:
    """What the objective hands a head's loss: the N scored block slots of a batch."""

    drafter: DFlashDrafter
    states: torch.Tensor
    """[N, D] the backbone's normed states of the scored slots."""
    labels: torch.Tensor
    """[N] the tokens they train toward (the sample's, or the target's top-1 with --hard-label target)."""
    weights: torch.Tensor
    """[N] the slots' loss weights (with grad where the acceptance weighting has one: detach to use)."""
    input_ids: torch.Tensor
    """[B, T] the batch's tokens."""
    rows: tuple[torch.Tensor, torch.Tensor]
    """(batch row [N], cache row [N]) of each slot: slot k+1 of the block at anchor p is row p+k."""
    top_ids: torch.Tensor | None
    """[N, K] the backbone's top-K ids (K = the head's `candidates`), None where it asks for none."""
    gather_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(states [N, D], ids [N, C]) -> their logits [N, C], chunked like the backbone's loss."""
    block_states: torch.Tensor | None = None
    """[B, A, block_size, D] every block slot's normed state, the anchor's first (XPress reads whole blocks)."""
    anchors: torch.Tensor | None = None
    """[B, A] each block's anchor position (padding blocks included)."""
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(batch row, block, k) [N] of each scored slot: slot k+1 of block (row, block) in `block_states`."""
    context: torch.Tensor | None = None
    """[B, T, K*D] the captured target states the drafter read (noise included); LiLiCorr fuses the
    anchor's (the last verified token's) from them."""
    label_logprobs: torch.Tensor | None = None
    """[N] the backbone's log-probability of each label, detached (with the candidates' logits from
    `gather_logits`, their full-vocabulary log-probs)."""
    soft_labels: dict[str, torch.Tensor] = field(default_factory=dict)
    """The slots' soft labels where the run uses them (--soft-label-weight > 0), else empty: the
    target's top-k (soft_ids, soft_logprobs renormalized, [N, k]) or its last states (soft_hidden)."""
    compiled: bool = False
    """The drafter is compiled and on CUDA: a head may run its parts as compiled kernels."""

    @property
    def predecessors(self) -> torch.Tensor:
        """[N] the true token before each slot (the anchor for slot 1)."""
        return self.input_ids[self.rows]


@dataclass
class HeadOutput:
    """A head's part of the loss of one batch."""

    loss: torch.Tensor
    """The term added to the backbone's loss (already weighted by the head's own setting)."""
    logged: torch.Tensor
    """The head's loss before its weight, detached (the run's metrics)."""
    choice: torch.Tensor
    """[N] the token the head drafts at each scored slot when the earlier slots were right."""


@dataclass(frozen=True)
class HeadMemory:
    """What a head adds to the memory of a training step, as the startup check estimates it
    (train/run/memory.py, docs/train.md "Long samples"); every figure 0 for plain DFlash."""

    params: int = 0
    """Trainable parameters (its modules and its wrappers in every draft layer): 18 bytes each with
    AdamW, the bf16 copies and the gradients."""
    layer_block_bytes: int = 0
    """Activations saved per block token and draft layer (its wrappers of the sublayers)."""
    slot_bytes: int = 0
    """Activations saved per scored slot by its loss (besides full-vocabulary logits)."""
    own_logit_rows: int = 0
    """Full-vocabulary logit rows per scored slot that the head's loss computes itself."""
    own_logit_bytes: int = 0
    """Bytes per logit of those rows: all at once where they fit `own_chunk_mib` of float32, else one
    chunk of CHUNK_MIB (head_loss.chunk_rows) at a time, recomputed in the backward."""
    own_chunk_mib: int | None = None
    """The limit of computing those rows at once: None, --logits-chunk-mib (as the backbone's)."""


class DraftHead:
    """A drafter kind on the DFlash backbone. Subclass it, set the class attributes, override what
    the head adds, and register one instance (`heads.register_head`, or `_BUILTIN` for a head of
    the package)."""

    name: str = ""
    """--drafter-type's value, and what checkpoints record as drafter_type."""
    title: str = ""
    """How messages and reports name the drafter (DFlash2)."""
    architecture: str = ""
    """The export's `architectures` entry, by which vLLM and SGLang pick the model class."""
    settings: ClassVar[type | None] = None
    """A kw_only dataclass of the head's drafter settings, declared in the head's module: each field
    a flag and config key of dflash-train (its docstring the --help text; train/config.py composes
    DrafterSettings from the registered heads' with runtime/settings.py `compose`), recorded in the
    drafter's DrafterConfig, its run identity and its export; the other heads' code ignores them.
    Its `refusal(self) -> Finding | None` returns the first setting out of its range (heads/limits.py),
    checked wherever the settings are built; what depends on the target's dimensions is `check`'s."""
    objective_settings: ClassVar[type | None] = None
    """A kw_only dataclass of the settings of the head's loss (its weights), composed into the
    objective's section (ObjectiveConfig) as `settings` into DrafterSettings; not in the run identity."""
    module_name: str | None = None
    """The attribute of the drafter that holds `build()`'s module: the prefix of its tensor names
    in checkpoints and exports (part of the export contract)."""
    config_key_names: tuple[str, ...] = ()
    """Keys of `export_keys` the engines read at the top level of config.json: the export writes
    them there too, and a reader takes them from there where dflash_config lacks them."""
    wrapper_names: ClassVar[dict[str, str]] = {}
    """Sublayer ("attention" or "mlp") -> the attribute of every draft layer that holds the
    head's wrapper of it (`wrap_sublayer`): the wrapper's tensors are `layers.N.<attribute>.*`."""
    picks_drafts: bool = False
    """The head chooses the drafted tokens (`objective` returns its choices, `proposer` decodes
    them): held-out evaluation reports the backbone's own tau beside the drafter's."""
    reads_whole_block: bool = False
    """The proposer's walk is called with every slot's state, the anchor's first ([B, T, D] at the
    trained block size T), the anchors and the tokens before them ([B]), and returns T-1 drafts."""
    default_hard_label: str = "sample"
    """--hard-label when not given, where the cache stores the target's top-1 (else sample)."""
    warm_starts_from: tuple[str, ...] = ()
    """Other heads whose exports may start a run of this one (--init-drafter): the backbone's
    tensors load and this head's own keep their fresh start."""
    serving: ClassVar[dict[str, Any]] = {}
    """The model card's serving facts, as read from vLLM 0.34.0 (`--speculative-config`; without a
    `method` it detects the speculator from the draft checkpoint's architectures) and SGLang 0.5.23:
    name, vllm_method (None: detected), sglang_algorithm, tags."""

    @property
    def setting_names(self) -> tuple[str, ...]:
        """The names of the head's drafter settings (`settings`' fields, in their order)."""
        return tuple(f.name for f in fields(self.settings)) if self.settings is not None else ()

    # -- the model --------------------------------------------------------------------------

    def check(self, config: DrafterConfig) -> None:
        """Refuse settings this head cannot build with the target's dimensions (HeadSettingError, a
        ValueError, naming the flag and the fix); their ranges are `settings`' own `refusal`."""

    def wrap_sublayer(self, config: DrafterConfig, sublayer: str) -> nn.Module:
        """The wrapper of `sublayer` (a key of `wrapper_names`) in one draft layer: a module with
        `prepare(x, block_size) -> (input, state)` and `finish(output, state, block_size)`."""
        raise NotImplementedError(f"head {self.name!r} names a wrapper of {sublayer} but builds none.")

    def build(self, config: DrafterConfig) -> nn.Module | None:
        """The head's module on the backbone's states (held as `module_name`), or None; or
        {attribute: module} for a head whose export names several (`module_name` is the first)."""
        return None

    def initialize(self, drafter: DFlashDrafter, std: float) -> None:
        """The head's own start, after the backbone's (every Linear normal(std), every norm 1)."""

    def owns_tensor(self, name: str) -> bool:
        """Whether a drafter tensor is one of this head's own (its module's or its wrappers')."""
        return bool((self.module_name and name.startswith(self.module_name + "."))
                    or any(f".{attr}." in name for attr in self.wrapper_names.values()))

    def sharded_units(self, drafter: DFlashDrafter) -> list[nn.Module]:
        """The drafter's modules of this head that FSDP2 shards as units of their own
        (train/run/distributed.py): the loss and the decode call them outside the drafter's forward.
        FSDP gathers a unit's parameters in its forward's pre-hook, so each must be called through
        its forward: a head that calls its module through other methods names the submodules those
        methods call. Default: every top-level submodule with parameters whose tensors
        (`<attribute>.*`) the head owns."""
        return [module for attribute, module in drafter.named_children()
                if self.owns_tensor(attribute + ".") and next(module.parameters(), None) is not None]

    # -- training ---------------------------------------------------------------------------

    def candidates(self, config: DrafterConfig) -> int:
        """How many of the backbone's top tokens per slot the head's loss reads (0: none)."""
        return 0

    def objective(self, inputs: HeadInputs, objective: ObjectiveConfig) -> HeadOutput | None:
        """The head's loss term and its choices over the scored slots, or None (the backbone's
        argmax drafts)."""
        return None

    def memory(self, config: DrafterConfig) -> HeadMemory:
        """What the head adds to a training step's memory (`HeadMemory`): rough figures from its
        modules' shapes, for the startup check. `config`: the drafter's dimensions (hidden_size,
        vocab_size, intermediate_size, num_hidden_layers, block_size, ...) and its settings."""
        return HeadMemory()

    # -- decoding ---------------------------------------------------------------------------

    def proposer(self, drafter: DFlashDrafter, temperature: float, seed: int
                 ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """(states [B, L, D] of a block's drafted slots, anchors [B]) -> drafts [B, L], or (drafts,
        confidence [B, L]) for a head that predicts each draft's acceptance probability (dflash-eval
        --confidence-threshold stops a block there); or None for the backbone's argmax. Any drafts
        are lossless: verification keeps the target's tokens."""
        return None

    # -- the export and the run -------------------------------------------------------------

    def export_keys(self, config: DrafterConfig) -> dict[str, Any]:
        """The `dflash_config` keys the engines' loaders read for this head."""
        return {}

    def settings_from_export(self, dflash_config: dict[str, Any]) -> dict[str, Any]:
        """DrafterConfig values read back from an export's `dflash_config` (HeadExportError, a
        ValueError, for what the head cannot serve)."""
        return {}

    def identity(self, config: Any) -> dict[str, Any]:
        """The head's part of the run identity a resumed run must share with its checkpoint."""
        return {"drafter_type": self.name, **{n: getattr(config, n) for n in self.setting_names}}

    def describe(self, config: DrafterConfig, shape: str) -> str:
        """The startup line's word on the drafter (`shape`: its layers, block and target layers)."""
        return f"{self.title} ({shape}), exported as {self.architecture}"

    def warm_start_note(self) -> str:
        """How this head's own tensors start when a drafter of another head warm-starts it."""
        return "at their fresh start"
