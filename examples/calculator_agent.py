"""A calculator agent written with the plain `openai` client, trained through aligner's endpoint (docs/agents.md).

It plays the built-in task's tool episode (conf=tiny_tools): the model may call the calculator, the
agent runs the call and sends back the result, and the model's turn without a call is its answer.
Nothing in it is aligner-specific except where it reads its task and its episode id:

    OPENAI_BASE_URL, OPENAI_API_KEY   the endpoint and the run's token (the openai client reads them itself)
    ALIGNER_EPISODE_ID                sent as the X-Episode-Id header, so aligner records the calls under it
    ALIGNER_MODEL                     the served model's name
    ALIGNER_PROMPT, ALIGNER_METADATA  the task: the prompt text and its row's metadata (JSON)

It reports its reward (1 for the exact sum, else 0) to ``POST /v1/episodes/{id}/reward``; without that
report, aligner's rule reward scores the final answer instead.

Run by hand against a served policy: ALIGNER_PROMPT='12+39=' ALIGNER_METADATA='{"answer": "51"}' \
ALIGNER_EPISODE_ID=try-1 ALIGNER_MODEL=aligner-policy OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/calculator_agent.py
"""

from __future__ import annotations

import json
import os

import openai

from aligner.envs.tools import get_tool  # the tool itself: any Python function would do

MAX_TURNS = 2  # as conf=tiny_tools' env.max_turns: a call, then the answer


def main() -> int:
    episode = os.environ["ALIGNER_EPISODE_ID"]
    metadata = json.loads(os.environ.get("ALIGNER_METADATA", "{}"))
    client = openai.OpenAI(default_headers={"X-Episode-Id": episode}, max_retries=2)
    calculator = get_tool("calculator")
    messages = [{"role": "user", "content": os.environ["ALIGNER_PROMPT"]}]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=os.environ["ALIGNER_MODEL"], messages=messages, tools=[calculator.spec()])
        message = reply.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message)
        for call in message.tool_calls:
            try:
                result = calculator.call(json.loads(call.function.arguments))
            except ValueError as e:  # a malformed call or a refused expression: the model reads the error
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    reward = float(answer.strip() == str(metadata.get("answer", "")).strip())
    client.post(f"/episodes/{episode}/reward", body={"reward": reward}, cast_to=object)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
