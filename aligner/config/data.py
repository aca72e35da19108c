"""The data's schema: the tokenizer, the training/eval data files, and the built-in task."""

from __future__ import annotations

from dataclasses import dataclass

from aligner.config.common import DATA_FORMATS, _check, _choice


@dataclass(kw_only=True)
class TokenizerConfig:
    """Where the tokenizer comes from."""

    path: str = ""  # HF tokenizer dir, tokenizer.json or tokenizer.model; "" = the built-in task's own tokenizer
    chat_template: str = ""  # Jinja chat template overriding the tokenizer's; "" = tokenizer's or the default


@dataclass(kw_only=True)
class DataConfig:
    """Training/eval data."""

    train_path: str = ""  # jsonl/json/parquet file or saved HF dataset dir; "" = the built-in task
    eval_path: str = ""  # held-out split; "" = built-in task's or a slice of train
    format: str = "auto"  # auto or one of DATA_FORMATS (the keys of aligner.data.formats.FORMATS)
    max_prompt_len: int = 64  # tokens; longer prompts follow `truncation`
    max_seq_len: int = 128  # tokens, prompt + response
    truncation: str = "error"  # error | left | right | skip: what to do with over-long rows
    skip_invalid: bool = False  # skip (and count) invalid rows instead of failing
    packing: bool = False  # pack several SFT samples into one sequence
    eval_fraction: float = 0.05  # fraction of train held out when eval_path is empty
    shuffle_seed: int = 0  # order of samples per epoch
    apply_chat_template: bool = False  # render plain-text prompts as one user turn through the tokenizer's chat template (instruct models)
    prompt_suffix: str = ""  # appended to every plain-text prompt before rendering (e.g. an answer-format instruction)

    def validate(self, prefix: str = "data") -> None:
        _choice(f"{prefix}.format", self.format, ("auto", *DATA_FORMATS))
        _choice(f"{prefix}.truncation", self.truncation, ("error", "left", "right", "skip"))
        _check(self.max_prompt_len > 0, f"{prefix}.max_prompt_len", self.max_prompt_len, "must be positive")
        _check(
            self.max_seq_len > self.max_prompt_len,
            f"{prefix}.max_seq_len",
            self.max_seq_len,
            f"must exceed {prefix}.max_prompt_len={self.max_prompt_len}",
        )
        _check(0.0 <= self.eval_fraction < 1.0, f"{prefix}.eval_fraction", self.eval_fraction, "must be in [0, 1)")


@dataclass(kw_only=True)
class TaskConfig:
    """The built-in arithmetic task used by the embedded default (aligner.data.task)."""

    name: str = "addition"  # built-in task name
    seed: int = 1234  # generator seed: the whole task is a function of it
    min_digits: int = 1  # smallest operand width
    max_digits: int = 2  # largest operand width
    num_sft: int = 4000  # SFT demonstrations, rows
    carry_error_rate: float = 0.6  # fraction of carry problems whose SFT demonstration forgets the carry (wrong)
    num_pairs: int = 3000  # preference pairs for the RM, rows
    num_rl: int = 2000  # RL prompts, rows
    num_eval: int = 256  # held-out problems (disjoint from every train split), rows per eval split
    tokenizer_vocab_size: int = 256  # upper bound on the trained BPE vocabulary, tokens (specials included)
    tool_demo_rate: float = 0.0  # fraction of SFT demonstrations that call the calculator (conf=tiny_tools; aligner.data.task)

    def validate(self, prefix: str = "task") -> None:
        _choice(f"{prefix}.name", self.name, ("addition",))
        _check(
            0 < self.min_digits <= self.max_digits <= 9, f"{prefix}.min_digits", self.min_digits, "need 0 < min_digits <= max_digits <= 9"
        )
        _check(0.0 <= self.carry_error_rate <= 1.0, f"{prefix}.carry_error_rate", self.carry_error_rate, "must be in [0, 1]")
        _check(0.0 <= self.tool_demo_rate < 1.0, f"{prefix}.tool_demo_rate", self.tool_demo_rate, "must be in [0, 1)")
        for name in ("num_sft", "num_pairs", "num_rl", "num_eval"):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        _check(
            self.tokenizer_vocab_size >= 20,
            f"{prefix}.tokenizer_vocab_size",
            self.tokenizer_vocab_size,
            "must be >= 20 (specials, digits and +-=)",
        )
