"""The embedded SmolLM2-135M-Instruct with its fitted artifact behind the server (slow: converts, calibrates, fits)."""

from __future__ import annotations

import pytest
import torch
from serve_kit import Server, load_engine

from oscar_cli.serve.engine import SamplingParams

CONTEXT = ("The Seine is a river in northern France. It flows through Paris, the capital of France, and into the "
           "English Channel at Le Havre. Paris has been the capital since the tenth century; the city is known for "
           "the Eiffel Tower, the Louvre museum and its cafés. Lyon and Marseille are the next largest cities. ")


@pytest.mark.slow
def test_smollm2_with_artifact_through_the_openai_client(embedded_store, embedded_artifact):
    from oscar_cli.artifact import load_artifact
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.models import load_model
    from oscar_cli.prepare import head_dim_of, prepare

    srv = Server(load_engine("smollm2-135m", embedded_store, embedded_artifact))
    eng, client = srv.engine, srv.client()
    try:
        (card,) = client.models.list().data
        assert card.id == "smollm2-135m" and card.oscar["method"] == "oscar"
        assert card.oscar["scheme"] == {"bits": 2, "group": 64, "sink": 16, "recent": 64, "scale_dtype": "fp16",
                                           "levels": "uniform"}

        # chat through the ChatML template, long enough that the INT2 part of the cache is read (> sink + recent)
        messages = [{"role": "user", "content": CONTEXT * 2 + "Question: what is the capital of France? "
                                                               "Answer with one word."}]
        ids = eng.chat_ids(messages)
        assert len(ids) > 2 * 80 and eng.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
        r = client.chat.completions.create(model=card.id, messages=messages, max_tokens=32, temperature=0)
        ref = eng.generate(ids, SamplingParams(max_tokens=32, temperature=0))
        content = r.choices[0].message.content
        assert content == ref.text and r.usage.prompt_tokens == len(ids)
        assert r.choices[0].finish_reason == "stop"  # <|im_end|> ended it
        assert "Paris" in content
        parts = list(client.chat.completions.create(model=card.id, messages=messages, max_tokens=32, temperature=0,
                                                    stream=True))
        assert "".join(p.choices[0].delta.content or "" for p in parts) == content

        # echo + logprobs equal oscar's teacher-forced decode-equivalent scoring of the same tokens
        prompt = CONTEXT * 2
        c = client.completions.create(model=card.id, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                      temperature=0)
        lp = c.choices[0].logprobs
        assert c.choices[0].text == prompt and lp.token_logprobs[0] is None
        loaded = load_model("smollm2-135m", embedded_store)
        art = load_artifact(embedded_artifact, loaded.fingerprint)
        m = get_method("oscar")
        prepare(loaded.model, m, scheme_for(m, head_dim_of(loaded.model.config), artifact_scheme=art.scheme), art)
        pids = eng.encode(prompt)
        with torch.no_grad():
            logp = torch.log_softmax(loaded.model(torch.tensor([pids]), use_cache=False).logits[0].float(), -1)
        want = logp[torch.arange(len(pids) - 1), torch.tensor(pids[1:])]
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, rtol=0, atol=1e-3)
    finally:
        srv.stop()
