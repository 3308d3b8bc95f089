"""Greedy decoding of a GGUF file by llama.cpp (llama-cpp-python), run by the python of the
venv llama.cpp is installed in (never the project's: tests/test_gguf_export.py starts it as a
subprocess). Needs only llama_cpp and numpy.

    python llamacpp_greedy.py MODEL.gguf IDS_JSON NEW_TOKENS LOGITS.npy

Feeds the prompt ids (a JSON list), then takes the argmax of llama.cpp's logits NEW_TOKENS
times (EOS ignored), feeding each id back. Prints `{"ids": [...], "system": "..."}` as JSON on
stdout and saves the logits it chose from, float32 `[NEW_TOKENS, vocab]`, to LOGITS.npy.
"""
import json
import sys

import numpy as np
from llama_cpp import Llama, llama_print_system_info


def main(model: str, ids_json: str, new_tokens: str, logits_path: str) -> None:
    prompt = json.loads(ids_json)
    n = int(new_tokens)
    llm = Llama(model_path=model, n_ctx=len(prompt) + n + 8, n_threads=2, n_threads_batch=2,
                n_batch=512, logits_all=True, verbose=False)
    llm.eval(prompt)
    ids, rows = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        rows.append(row)
        ids.append(int(row.argmax()))
        llm.eval([ids[-1]])
    np.save(logits_path, np.stack(rows))
    print(json.dumps({"ids": ids, "system": llama_print_system_info().decode()}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
