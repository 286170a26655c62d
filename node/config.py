"""Node settings: one pydantic model, filled from flags, environment and a YAML file.

Precedence, highest first: command-line flags, `FTIS_*` environment variables, the YAML
file named by `--config` (or `FTIS_CONFIG`), then the defaults below. The CLI builds its
`join`/`train` options from these fields, so the help text of a flag is the
`description` written here and nothing can drift between the two.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

LOSS_CHOICES = ("f-tis", "tis", "vis", "nois", "f-nois", "f-vis", "alone")
DEFAULT_PORT = 31337
DEFAULT_API_PORT = 8470
# The YAML file of the `load` call in progress (pydantic-settings asks the class for sources).
_YAML_FILE: ContextVar[Path | None] = ContextVar("ftis_yaml_file", default=None)


def default_data_root() -> Path:
    """Where nodes keep identities and checkpoints unless told otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "ftis-node"


class NodeConfig(BaseSettings):
    """Everything one node needs to run. Field descriptions double as `--help` text."""

    model_config = SettingsConfigDict(env_prefix="FTIS_", extra="forbid", validate_default=True)

    # --- identity and storage
    name: str = Field("node", description="Human-readable node name (shown on the dashboard).")
    data_dir: Path | None = Field(
        None,
        description="Folder for identity keys and checkpoints [default: ~/.local/share/ftis-node/<name>].",
    )
    # --- model, task, engine
    model: str = Field("tiny-s", description="Model alias (see `ftis-node models`) or a local HF folder.")
    task: str = Field("toy", description="Task spec, e.g. toy, toy:ood, gym:chain_sum, gsm8k:/path/train.jsonl.")
    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine: hf (CPU default) or vllm (GPU).")
    train_mode: Literal["lora", "full"] = Field("lora", description="Train a LoRA adapter or the full model.")
    lora_rank: int = Field(8, ge=1, description="LoRA rank.")
    lr: float | None = Field(None, gt=0, description="Learning rate [default: 1e-6 full, 2e-4 LoRA].")
    threads: int = Field(0, ge=0, description="CPU threads for torch (0 = torch's default).")
    device: str = Field("cpu", description="Where the trainer and the hf engine run: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights' dtype in the trainer and the hf engine (bfloat16 on GPUs)."
    )
    # --- the round
    rounds: int | None = Field(None, ge=1, description="Stop after this many rounds [default: run until stopped].")
    round_seconds: float = Field(30.0, gt=0, description="Length of a time-bucketed round, in seconds.")
    prompts_per_round: int = Field(8, ge=1, description="Own prompts answered per round.")
    group_size: int = Field(12, ge=2, description="Completions per prompt (G).")
    max_tokens: int = Field(32, ge=1, description="Maximum completion tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (recorded in every packet).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling p (1 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    seed: int = Field(0, description="Seed for task sampling, generation and training.")
    # 10: a full fine-tune's checkpoint is the weights plus AdamW's two moments, 3x the weights
    # (18 GB for a 3B model in bf16, 36 GB in fp32), written and hashed: every round it would
    # cost about as much as the round itself; every 10 rounds it is a few % of them, and a
    # crash loses at most 10 rounds (5 minutes at the default 30 s rounds). The engine gets
    # the new weights every round regardless.
    checkpoint_every: int = Field(
        10, ge=1, description="Write a durable checkpoint every N rounds and at stop; a crash loses at most N rounds."
    )
    # --- the loss
    loss: str = Field("f-tis", description="Loss variant: " + ", ".join(LOSS_CHOICES) + ".")
    is_cap: float = Field(2.0, gt=0, description="C, the cap of the truncated IS weight.")
    kl_threshold: float | None = Field(
        None, gt=0, description="g, the filter's KL threshold [default: 50 for sum, 0.5 for mean]."
    )
    kl_reduction: Literal["sum", "mean"] = Field("sum", description="KL reduction over a sequence's tokens.")
    peer_share: float = Field(0.5, ge=0, le=1, description="Largest share of peers' samples in a batch.")
    cross_tokenizer: Literal["graft", "drop"] = Field(
        "graft", description="Peers with another tokenizer: sequence-level weight (graft) or drop."
    )
    # --- the swarm
    swarm: list[str] = Field(
        default_factory=list, description="Multiaddr of a peer to join (repeatable). None: start a new swarm."
    )
    swarm_id: str = Field("ftis", description="Swarm name; only nodes with the same name exchange packets.")
    host: str = Field("0.0.0.0", description="Interface to listen on.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port for the DHT (0 = any free port).")
    announce: list[str] = Field(default_factory=list, description="Multiaddrs to announce (public address).")
    client_mode: bool = Field(False, description="Do not accept incoming connections (behind NAT).")
    auto_relay: bool = Field(False, description="Reach peers through relays (behind NAT).")
    startup_timeout: float = Field(60.0, gt=0, description="Seconds to wait for the DHT to start.")
    gather_seconds: float = Field(5.0, ge=0, description="Longest wait for peers' packets each round.")
    expect_peers: int | None = Field(None, ge=0, description="Stop waiting once this many peers answered.")
    # --- the status API
    api_host: str = Field("127.0.0.1", description="Interface of the REST status API and dashboard.")
    api_port: int | None = Field(DEFAULT_API_PORT, ge=0, le=65535, description="API port (0 = any free port).")

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        value = value.lower()
        if value not in LOSS_CHOICES:
            raise ValueError(f"unknown loss {value!r}; use one of: {', '.join(LOSS_CHOICES)}")
        return value

    @property
    def node_dir(self) -> Path:
        return self.data_dir or default_data_root() / self.name

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> NodeConfig:
        """Flags (`overrides`, None = not given) > env > YAML file > defaults."""
        config_file = config_file or (Path(p) if (p := os.environ.get("FTIS_CONFIG")) else None)
        if config_file is not None and not Path(config_file).is_file():
            raise FileNotFoundError(f"config file {config_file} not found")
        token = _YAML_FILE.set(config_file)
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
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
