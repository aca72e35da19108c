"""aligner: RLHF (SFT, reward model, PPO) for Llama-family models on torch + Ray."""

__version__ = "0.1.0"
