"""Node settings: one pydantic model, filled from flags, environment and a YAML file.

Precedence, highest first: command-line flags, `FTIS_*` environment variables, the YAML
file named by `--config` (or `FTIS_CONFIG`), then the defaults below. The CLI builds its
`join`/`train` options from these fields, so the help text of a flag is the
`description` written here and nothing can drift between the two.

One source per setting. Most settings are handed on to the part that uses them: the loss
(`LossConfig`), the trainer (`TrainerConfig`), the sampler (`Sampling`) and the swarm
(`SwarmConfig`). Their bounds are not copied here: `NodeConfig` validates each value by
building that part's own config (`loss_config()`, `trainer_config()`, ...), so a value they
would refuse is refused here, before anything starts, under this setting's flag. Their
defaults are written here too, because those modules import torch and hivemind and
`ftis-node --help` must answer at once; `SOURCES` names each owner, and a test holds every
default here equal to its owner's. Protocol limits (`protocol.Limits`) and the swarm id
rule (`protocol.keys`) are imported directly.
"""

from __future__ import annotations

import copy
import difflib
import os
import types
import typing
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from node.defence.screen import ScreenConfig
from node.defence.trust import TrustConfig
from node.groups import PROBATION_SHARE
from protocol import MAX_DISPLAY_NAME_CHARS, Limits, ProtocolError
from protocol.keys import validate_swarm_id

ENV_PREFIX = "FTIS_"
#: `--loss`: the loss variants of node/train/ftis.py (`VARIANTS`), and `alone` (train on own samples only).
Loss = Literal["f-tis", "tis", "vis", "nois", "f-nois", "f-vis", "alone"]
LOSS_CHOICES: tuple[str, ...] = typing.get_args(Loss)
DEFAULT_API_PORT = 8470
#: What the packet codec accepts; a node must never build a packet its peers refuse.
LIMITS = Limits()

# Where each setting is validated and used: NodeConfig field -> (module, class, field there).
SOURCES: dict[str, tuple[str, str, str]] = {
    "loss": ("node.train.ftis", "LossConfig", "variant"),
    "is_cap": ("node.train.ftis", "LossConfig", "is_cap"),
    "kl_threshold": ("node.train.ftis", "LossConfig", "kl_threshold"),
    "kl_reduction": ("node.train.ftis", "LossConfig", "kl_reduction"),
    "train_mode": ("node.train.trainer", "TrainerConfig", "mode"),
    "lora_rank": ("node.train.trainer", "TrainerConfig", "lora_rank"),
    "lr": ("node.train.trainer", "TrainerConfig", "lr"),
    "seed": ("node.train.trainer", "TrainerConfig", "seed"),
    "device": ("node.train.trainer", "TrainerConfig", "device"),
    "dtype": ("node.train.trainer", "TrainerConfig", "dtype"),
    "gradient_checkpointing": ("node.train.trainer", "TrainerConfig", "gradient_checkpointing"),
    "temperature": ("node.rollout.base", "Sampling", "temperature"),
    "top_p": ("node.rollout.base", "Sampling", "top_p"),
    "top_k": ("node.rollout.base", "Sampling", "top_k"),
    "max_tokens": ("node.rollout.base", "Sampling", "max_tokens"),
    "swarm_id": ("node.swarm.dht", "SwarmConfig", "swarm_id"),
    "host": ("node.swarm.dht", "SwarmConfig", "host"),
    "port": ("node.swarm.dht", "SwarmConfig", "port"),
    "announce": ("node.swarm.dht", "SwarmConfig", "announce_maddrs"),
    "client_mode": ("node.swarm.dht", "SwarmConfig", "client_mode"),
    "auto_relay": ("node.swarm.dht", "SwarmConfig", "use_auto_relay"),
    "startup_timeout": ("node.swarm.dht", "SwarmConfig", "startup_timeout"),
    "swarm_wait": ("node.swarm.dht", "SwarmConfig", "bootstrap_wait_s"),
    "round_seconds": ("node.swarm.dht", "SwarmConfig", "round_seconds"),
    "max_peers_per_round": ("node.swarm.dht", "SwarmConfig", "max_peers_per_round"),
    "shards": ("node.swarm.dht", "SwarmConfig", "shards"),
    "max_packet_bytes": ("node.swarm.dht", "SwarmConfig", "max_packet_bytes"),
    "screen_logprob_floor": ("node.defence.screen", "ScreenConfig", "logprob_floor"),
    "screen_top_k": ("node.defence.screen", "ScreenConfig", "support_top_k"),
    "screen_max_run": ("node.defence.screen", "ScreenConfig", "max_run"),
    "screen_max_flagged": ("node.defence.screen", "ScreenConfig", "max_flagged"),
    "claim_margin": ("node.defence.screen", "ScreenConfig", "claim_margin"),
    "probation_rounds": ("node.defence.trust", "TrustConfig", "probation_rounds"),
    "quarantine_fraction": ("node.defence.trust", "TrustConfig", "quarantine_fraction"),
    "quarantine_after": ("node.defence.trust", "TrustConfig", "quarantine_after"),
    "quarantine_rounds": ("node.defence.trust", "TrustConfig", "quarantine_rounds"),
    "trust_groups": ("node.defence.trust", "TrustConfig", "trust_groups"),
}


class GenerationDefaults(BaseModel):
    """What `--task`, `--max-tokens`, `--temperature` and `--chat-template` mean when not given."""

    task: str
    chat_template: bool
    max_tokens: int
    temperature: float


# The project's tiny models answer in a dozen tokens and were warm-started at T = 1. An
# instruct model (its tokenizer has a chat template) needs the template to answer at all,
# room to write a sentence around its answer, and a task its size can get right sometimes
# (SmolLM2-135M scores 0 on `toy`, about 0.2 on 1-digit sums); see README, "SmolLM2 on a CPU".
PLAIN_DEFAULTS = GenerationDefaults(task="toy", chat_template=False, max_tokens=32, temperature=1.0)
INSTRUCT_DEFAULTS = GenerationDefaults(
    task="gym:chain_sum?max_terms=2&max_digits=1", chat_template=True, max_tokens=64, temperature=0.7
)


def _same_as(model: type[BaseModel], name: str) -> Any:
    """`model`'s field `name` (default, bounds, help) as a setting: one definition, no copy to drift."""
    return copy.deepcopy(model.model_fields[name])


def default_data_root() -> Path:
    """Where nodes keep identities and checkpoints unless told otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "ftis-node"


def _split_list(value: Any) -> Any:
    """A list setting from the environment or a flag: a JSON list, or items split on commas/spaces."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return yaml.safe_load(text)  # JSON is YAML
        return [item for item in text.replace(",", " ").split() if item]
    return value


Addrs = Annotated[list[str], NoDecode, BeforeValidator(_split_list)]


def _extra(default_text: str | None = None, **more: Any) -> dict[str, Any]:
    """Help metadata for fields whose default is computed (shown as `[default: ...]`)."""
    return {"default_text": default_text, **more} if default_text else more


class NodeConfig(BaseSettings):
    """Everything one node needs to run. Field descriptions double as `--help` text."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # --- identity and storage
    name: str = Field(
        "node",
        min_length=1,
        max_length=MAX_DISPLAY_NAME_CHARS,
        description="Human-readable node name; it travels in each packet, so peers show it too.",
    )
    data_dir: Path | None = Field(
        None,
        description="Folder for identity keys, checkpoints and status.json.",
        json_schema_extra=_extra("~/.local/share/ftis-node/<name>"),
    )
    # --- model, task, engine
    model: str = Field("tiny-s", description="Model alias (see `ftis-node models`), Hugging Face id or local folder.")
    task: str | None = Field(
        None,
        description="Task spec, e.g. toy, toy:ood, gym:chain_sum, gsm8k:/path/train.jsonl.",
        json_schema_extra=_extra(f"{INSTRUCT_DEFAULTS.task} for instruct models, {PLAIN_DEFAULTS.task}"),
    )
    reward: str | None = Field(
        None,
        description="Your reward functions, module:function[,module:function...] (TRL's signature; docs/tasks.md).",
        json_schema_extra=_extra("the task's own: the <answer> tag matches the reference", metavar="MODULE:FUNCTION"),
    )
    reward_weights: str | None = Field(
        None,
        description="Weights of the --reward functions, e.g. 1,0.5 (the reward is their weighted mean).",
        json_schema_extra=_extra("1 each"),
    )
    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine: hf (CPU default) or vllm (GPU).")
    train_mode: Literal["lora", "full"] = Field("lora", description="Train a LoRA adapter or the full model.")
    lora_rank: int = Field(8, description="LoRA rank.")
    lr: float | None = Field(None, description="Learning rate.", json_schema_extra=_extra("1e-6 full, 2e-4 LoRA"))
    threads: int = Field(0, ge=0, description="CPU threads for torch (0 = torch's default).")
    device: str = Field("cpu", description="Where the trainer and the hf engine run: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights' dtype in the trainer and the hf engine (bfloat16 on GPUs)."
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Padded tokens per training forward/backward pass.",
        json_schema_extra=_extra("256 on a CPU; on a GPU the largest of 4096, 2048, ..., 256 that fits"),
    )
    generate_batch: int | None = Field(
        None,
        ge=1,
        description="Sequences per generate call (the hf engine): the KV cache grows with it.",
        json_schema_extra=_extra("16 on a CPU, 64 on a GPU"),
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer in the backward pass: less memory, about a third more training time."
    )
    # --- the round
    rounds: int | None = Field(
        None, ge=1, description="Stop after this many rounds.", json_schema_extra=_extra("run until stopped")
    )
    round_seconds: float = Field(30.0, description="Length of a time-bucketed round, in seconds.")
    prompts_per_round: int = Field(
        8, ge=1, le=LIMITS.max_groups, description="Own prompts answered per round (groups in a packet)."
    )
    group_size: int = Field(12, ge=2, le=LIMITS.max_completions_per_group, description="Completions per prompt (G).")
    max_tokens: int | None = Field(
        None,
        le=LIMITS.max_tokens_per_completion,
        description="Maximum completion tokens.",
        json_schema_extra=_extra(f"{INSTRUCT_DEFAULTS.max_tokens} for instruct models, {PLAIN_DEFAULTS.max_tokens}"),
    )
    temperature: float | None = Field(
        None,
        description="Sampling temperature (recorded in every packet).",
        json_schema_extra=_extra(f"{INSTRUCT_DEFAULTS.temperature} for instruct models, {PLAIN_DEFAULTS.temperature}"),
    )
    top_p: float = Field(1.0, description="Nucleus sampling p (1 = off).")
    top_k: int = Field(0, description="Top-k sampling (0 = off).")
    chat_template: bool | None = Field(
        None,
        description="Wrap prompts in the model's chat template (own prompts and peers' alike).",
        json_schema_extra=_extra("on when the tokenizer has one"),
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="Seed for task sampling, generation and training; pin it for a reproducible run.",
        json_schema_extra=_extra("a hash of the node's peer id, so every node draws its own prompts and samples"),
    )
    # 10: a full fine-tune's checkpoint is the weights plus AdamW's two moments, 3x the weights
    # (18 GB for a 3B model in bf16, 36 GB in fp32), written and hashed: every round it would
    # cost about as much as the round itself; every 10 rounds it is a few % of them, and a
    # crash loses at most 10 rounds (5 minutes at the default 30 s rounds). The engine gets
    # the new weights every round regardless.
    checkpoint_every: int = Field(
        10, ge=1, description="Write a durable checkpoint every N rounds and at stop; a crash loses at most N rounds."
    )
    # --- the loss
    loss: Loss = Field("f-tis", description="Loss variant; alone = publish, but train on own samples only.")
    is_cap: float = Field(2.0, description="C, the cap of the truncated IS weight.")
    kl_threshold: float | None = Field(
        None, description="g, the filter's KL threshold.", json_schema_extra=_extra("50 for sum, 0.5 for mean")
    )
    kl_reduction: Literal["sum", "mean"] = Field("sum", description="KL reduction over a sequence's tokens.")
    peer_share: float = Field(0.5, ge=0, le=1, description="Largest share of peers' samples in a batch.")
    peer_mix: Literal["add", "replace"] = Field(
        "add",
        description="Peers' samples come on top of all own ones (add) or take their share of a batch "
        "the size of the own samples (replace: SAPO's local/external mix at equal batch).",
    )
    cross_tokenizer: Literal["graft", "drop"] = Field(
        "graft", description="Peers with another tokenizer: sequence-level weight (graft) or drop."
    )
    # --- hostile peers (docs/security.md)
    screen: bool = Field(
        True, description="Screen peers' completions under this node's own model; cut what follows their answers."
    )
    screen_logprob_floor: float = _same_as(ScreenConfig, "logprob_floor")
    screen_top_k: int = _same_as(ScreenConfig, "support_top_k")
    screen_max_run: int = _same_as(ScreenConfig, "max_run")
    screen_max_flagged: float = _same_as(ScreenConfig, "max_flagged")
    claim_margin: float = _same_as(ScreenConfig, "claim_margin")
    judge_model: str | None = Field(
        None,
        description="A local model that judges peers' completions (e.g. smollm2-135m-embedded).",
        json_schema_extra=_extra("no judge"),
    )
    judge_threshold: float = Field(0.5, gt=0, lt=1, description="Drop a completion the judge flags with this P(yes).")
    probation_rounds: int = _same_as(TrustConfig, "probation_rounds")
    trust_groups: int = _same_as(TrustConfig, "trust_groups")
    probation_share: float = Field(
        PROBATION_SHARE, ge=0, le=1, description="Largest share of a batch that all peers on probation together take."
    )
    quarantine_fraction: float = _same_as(TrustConfig, "quarantine_fraction")
    quarantine_after: int = _same_as(TrustConfig, "quarantine_after")
    quarantine_rounds: int = _same_as(TrustConfig, "quarantine_rounds")
    # --- the swarm
    swarm: Addrs = Field(
        default_factory=list,
        description="A peer to join: its multiaddr, or the status URL of any running node (http://host:8470). "
        "Repeatable.",
        json_schema_extra=_extra("start a new swarm", metavar="ADDR|URL"),
    )
    swarm_id: str = Field("ftis", description="Swarm name; only nodes with the same name exchange packets.")
    host: str = Field("0.0.0.0", description="Interface the DHT listens on.")
    port: int = Field(31337, description="TCP port for the DHT (0 = any free port).")
    announce: Addrs = Field(
        default_factory=list,
        description="Multiaddrs to announce (public address); repeatable.",
        json_schema_extra=_extra("the addresses it listens on", metavar="MULTIADDR"),
    )
    client_mode: bool = Field(False, description="Do not accept incoming connections (behind NAT).")
    auto_relay: bool = Field(False, description="Reach peers through relays (behind NAT).")
    startup_timeout: float = Field(60.0, description="Seconds to wait for the DHT to start.")
    swarm_wait: float = Field(
        120.0,
        gt=0,
        description="Seconds to keep asking a --swarm peer or status URL that does not answer yet (it may start).",
    )
    gather_seconds: float = Field(5.0, ge=0, description="Longest wait for peers' packets each round.")
    expect_peers: int | None = Field(
        None,
        ge=0,
        description="Stop waiting once this many peers answered.",
        json_schema_extra=_extra("wait until --gather-seconds"),
    )
    max_peers_per_round: int = Field(8, description="Peers' packets fetched per round at most (k).")
    shards: int = Field(0, description="DHT shard keys per round, a power of two (0 = from the swarm-size estimate).")
    max_packet_bytes: int = Field(
        LIMITS.max_bytes, description="Largest packet published, fetched or decoded (the protocol's Limits.max_bytes)."
    )
    # --- the status API
    api_host: str = Field("127.0.0.1", description="Interface of the REST status API and dashboard.")
    api_port: int | None = Field(DEFAULT_API_PORT, ge=0, le=65535, description="API port (0 = any free port).")

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_spelling(cls, value: Any) -> Any:
        return value.strip().lower().replace("_", "-") if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _name_rule(cls, value: str) -> str:
        # Peers show it (the packet refuses control characters) and it names the default data dir.
        if not value.isprintable() or value.strip() != value:
            raise ValueError("a name is one line of printable characters, without leading or trailing spaces")
        if "/" in value or "\\" in value or value in (".", ".."):
            raise ValueError("a name cannot hold '/' or '\\' or be '.' or '..': it names the default data folder")
        return value

    @field_validator("swarm_id")
    @classmethod
    def _swarm_id_rule(cls, value: str) -> str:
        try:
            return validate_swarm_id(value)  # the rule every DHT key is built with
        except ProtocolError as err:
            raise ValueError(str(err)) from None

    @model_validator(mode="after")
    def _owners_accept(self) -> NodeConfig:
        """Each part that takes these settings validates them now, not after the DHT started."""
        errors: list[dict[str, Any]] = []
        for build in (self.loss_config, self.trainer_config, self.sampling, self.swarm_config):
            try:
                build()
            except ValidationError as err:
                errors.extend(_as_own_errors(err))
        tokens = self.prompts_per_round * self.group_size * (self.max_tokens or INSTRUCT_DEFAULTS.max_tokens)
        if tokens > LIMITS.max_total_tokens:
            errors.append(
                _value_error(
                    "max_tokens",
                    self.max_tokens,
                    f"prompts-per-round x group-size x max-tokens = {tokens} tokens is over the "
                    f"{LIMITS.max_total_tokens} a packet may carry",
                )
            )
        unique = list({(e["loc"], e["type"]): e for e in errors}.values())  # the trainer re-checks the loss
        if unique:
            raise ValidationError.from_exception_data(type(self).__name__, unique)  # type: ignore[arg-type]
        return self

    # ------------------------------------------------------------------ the parts' own configs
    def loss_config(self) -> Any:
        from node.train.ftis import LossConfig

        return LossConfig(
            variant="f-tis" if self.loss == "alone" else self.loss,
            is_cap=self.is_cap,
            kl_reduction=self.kl_reduction,
            kl_threshold=self.kl_threshold,
        )

    def trainer_config(self) -> Any:
        from node.train.trainer import TrainerConfig

        return TrainerConfig(
            mode=self.train_mode,
            lora_rank=self.lora_rank,
            lr=self.lr,
            loss=self.loss_config(),
            seed=self.seed if self.seed is not None else 0,  # the node resolves None before it builds its trainer
            device=self.device,
            dtype=self.dtype,
            micro_batch_tokens=self.micro_batch_tokens or 4096,  # None: preflight fits it to the machine
            gradient_checkpointing=self.gradient_checkpointing,
        )

    def generate_batch_size(self) -> int:
        """Sequences per generate call: the given one, else the device's default (node.memory)."""
        from node.memory import CPU_GENERATE_BATCH, GPU_GENERATE_BATCH

        if self.generate_batch:
            return self.generate_batch
        return GPU_GENERATE_BATCH if self.device.startswith("cuda") else CPU_GENERATE_BATCH

    def generation(self, has_chat_template: bool) -> GenerationDefaults:
        """Task, chat template, max tokens and temperature for a model, the given ones winning."""
        base = INSTRUCT_DEFAULTS if has_chat_template else PLAIN_DEFAULTS
        chat = self.chat_template if self.chat_template is not None else base.chat_template
        return GenerationDefaults(
            task=self.task if self.task is not None else base.task,
            chat_template=chat and has_chat_template,
            max_tokens=self.max_tokens if self.max_tokens is not None else base.max_tokens,
            temperature=self.temperature if self.temperature is not None else base.temperature,
        )

    def sampling(self, has_chat_template: bool = False) -> Any:
        from node.rollout.base import Sampling

        gen = self.generation(has_chat_template)
        return Sampling(temperature=gen.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=gen.max_tokens)

    def swarm_config(self, **runtime: Any) -> Any:
        """The swarm's settings; `runtime` adds what only the daemon knows (peers, identity)."""
        from node.swarm.dht import SwarmConfig

        return SwarmConfig(
            swarm_id=self.swarm_id,
            host=self.host,
            port=self.port,
            announce_maddrs=self.announce,
            client_mode=self.client_mode,
            use_auto_relay=self.auto_relay,
            startup_timeout=self.startup_timeout,
            bootstrap_wait_s=self.swarm_wait,
            round_seconds=self.round_seconds,
            max_peers_per_round=self.max_peers_per_round,
            shards=self.shards,
            max_packet_bytes=self.max_packet_bytes,
            **runtime,
        )

    @property
    def screen_config(self) -> ScreenConfig:
        return ScreenConfig(
            enabled=self.screen,
            logprob_floor=self.screen_logprob_floor,
            support_top_k=self.screen_top_k,
            max_run=self.screen_max_run,
            max_flagged=self.screen_max_flagged,
            claim_margin=self.claim_margin,
        )

    @property
    def trust_config(self) -> TrustConfig:
        return TrustConfig(
            probation_rounds=self.probation_rounds,
            trust_groups=self.trust_groups,
            quarantine_fraction=self.quarantine_fraction,
            quarantine_after=self.quarantine_after,
            quarantine_rounds=self.quarantine_rounds,
        )

    @property
    def node_dir(self) -> Path:
        return self.data_dir or default_data_root() / self.name

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> NodeConfig:
        """Flags (`overrides`, None = not given) > env > YAML file > defaults.

        Raises SettingsError, whose lines name where each bad value came from.
        """
        config_file = config_file or (Path(p) if (p := os.environ.get(ENV_PREFIX + "CONFIG")) else None)
        if config_file is not None:
            _check_yaml(Path(config_file))
        flags = {k: v for k, v in overrides.items() if v is not None}
        token = _YAML_FILE.set(config_file)
        try:
            return cls(**flags)
        except ValidationError as err:
            raise SettingsError(describe_errors(err, flags, config_file)) from None
        finally:
            _YAML_FILE.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if (yaml_file := _YAML_FILE.get()) is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


# The YAML file of the `load` call in progress (pydantic-settings asks the class for sources).
_YAML_FILE: ContextVar[Path | None] = ContextVar("ftis_yaml_file", default=None)


class SettingsError(ValueError):
    """Bad settings; `lines` holds one readable line per bad value."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _check_yaml(path: Path) -> None:
    if not path.is_file():
        raise SettingsError([f"--config {path}: file not found"])
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise SettingsError([f"--config {path}: not readable YAML ({str(err).splitlines()[0]})"]) from None
    if data is not None and not isinstance(data, dict):
        raise SettingsError([f"--config {path}: expected keys and values (like `model: tiny-s`)"])


def _env_value(field: str) -> str | None:
    wanted = env_name(field).lower()  # pydantic-settings matches env names case-insensitively
    return next((v for k, v in os.environ.items() if k.lower() == wanted), None)


def source_of(field: str, flags: dict[str, Any], config_file: Path | None) -> str:
    """Where the value of `field` came from, as the user would type it."""
    if field in flags:
        value = flags[field]
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        return f"{flag_name(field)} {shown}"
    if (env := _env_value(field)) is not None:
        return f"{env_name(field)}={env}"
    if config_file is not None:
        try:
            data = yaml.safe_load(Path(config_file).read_text()) or {}
        except (OSError, yaml.YAMLError):
            data = {}
        if field in data:
            return f"{field}: {data[field]} (in {config_file})"
    return flag_name(field)


def describe_errors(err: ValidationError, flags: dict[str, Any], config_file: Path | None) -> list[str]:
    """One line per bad value, naming the flag, variable or YAML key it came from."""
    fields = NodeConfig.model_fields
    lines = []
    for e in err.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(field, list(fields), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            where = f"in {config_file}" if config_file is not None else "given"
            lines.append(f"{field} {where}: not a setting{hint}")
        elif e["type"] == "literal_error" and field in fields:
            choices = typing.get_args(_strip_optional(fields[field].annotation))
            lines.append(f"{source_of(field, flags, config_file)}: use one of {', '.join(map(str, choices))}")
        else:
            lines.append(f"{source_of(field, flags, config_file)}: {message}" if field else message)
    return lines


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _value_error(field: str, value: Any, message: str) -> dict[str, Any]:
    return {"type": "value_error", "loc": (field,), "input": value, "ctx": {"error": ValueError(message)}}


def _as_own_errors(err: ValidationError) -> list[dict[str, Any]]:
    """A part's validation errors, re-addressed to the NodeConfig fields they came from."""
    owner = err.title
    reverse = {(cls, sub): mine for mine, (_, cls, sub) in SOURCES.items()}
    out = []
    for e in err.errors():
        sub = str(e["loc"][0]) if e["loc"] else ""
        if owner == "TrainerConfig" and sub == "loss":
            continue  # reported by the LossConfig check itself
        mine = reverse.get((owner, sub), sub or "settings")
        out.append({"type": e["type"], "loc": (mine,), "input": e.get("input"), "ctx": e.get("ctx", {})})
    return out
