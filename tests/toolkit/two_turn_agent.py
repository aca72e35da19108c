"""A test agent with the plain `openai` client: two calls per episode (the second after a user turn the
agent adds), each asking for the completion's token ids and log-probs (``return_token_ids``, ``logprobs``),
which it writes with its episode id to ``LOG_DIR/<episode id>.json`` (its first argument) for the test to compare with
what the trainer trained on. It reports a reward that varies between episodes (the first completion's
length mod 3, halved), so a group estimator's advantages are not all zero. With a second argument, an
episode whose id ends with it exits with code 3 after its first call (a crash: dropped).

    python tests/toolkit/two_turn_agent.py LOG_DIR [CRASH_SUFFIX]
"""

from __future__ import annotations

import json
import os
import sys

import openai


def main() -> int:
    log_dir, crash = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    episode = os.environ["ALIGNER_EPISODE_ID"]
    client = openai.OpenAI(default_headers={"X-Episode-Id": episode}, max_retries=0)
    messages = [{"role": "user", "content": os.environ["ALIGNER_PROMPT"]}]
    calls = []
    for _ in range(2):
        reply = client.chat.completions.create(
            model=os.environ["ALIGNER_MODEL"], messages=messages, logprobs=True, extra_body={"return_token_ids": True}
        )
        choice = reply.choices[0]
        extra = reply.model_extra or {}
        calls.append(
            {
                "prompt_token_ids": extra["prompt_token_ids"],
                "token_ids": choice.model_extra["token_ids"],
                "logprobs": [c.logprob for c in choice.logprobs.content],
            }
        )
        if crash and episode.endswith(crash):
            return 3
        messages += [{"role": "assistant", "content": choice.message.content or ""}, {"role": "user", "content": "Check again."}]
    with open(os.path.join(log_dir, f"{episode}.json"), "w") as f:
        json.dump(calls, f)
    reward = (len(calls[0]["token_ids"]) % 3) / 2
    client.post(f"/episodes/{episode}/reward", body={"reward": reward}, cast_to=object)
    return 0


if __name__ == "__main__":
    sys.exit(main())
