"""The "parrot" the agent-proxy tests serve: the tiny model fine-tuned, in a few seconds,
to answer three fixed conversations with fixed replies under greedy decoding (a
well-formed tool call, a malformed one, and plain text), so that a tools request meets a
reply that a model really generated. tests/inference/conftest.py serves it."""

from __future__ import annotations

from pathlib import Path

import torch

from areal_cli.data.chat import chat_prompt_ids

CALC = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
    },
}
ASK_TOOL = [{"role": "user", "content": "What is 12+34?"}]
ASK_BROKEN = [{"role": "user", "content": "What is 5+6?"}]
ASK_TEXT = [{"role": "user", "content": "hello"}]
TOOL_REPLY = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>'
BROKEN_REPLY = '<tool_call>{"name": "add", "arguments": {"a": 5</tool_call>'
TEXT_REPLY = "hi there friend"


def teach(model_dir: Path, out: Path) -> Path:
    """The tiny model, trained until greedy decoding gives each reply to its prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = [(ASK_TOOL, TOOL_REPLY), (ASK_BROKEN, BROKEN_REPLY), (ASK_TEXT, TEXT_REPLY)]
    examples = []
    for messages, reply in pairs:
        prompt = chat_prompt_ids(tok, messages, [CALC])
        target = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
        examples.append((prompt, target))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = 0.0
        for prompt, target in examples:
            ids = torch.tensor([prompt + target])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
