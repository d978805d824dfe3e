"""The GPT-OSS tokenizer files (``gptoss_patch.tools.tokenizer``) build and load with this cell's transformers.

vLLM 0.19 brings transformers 5.x, whose ``TikTokenConverter`` renamed its special-tokens keyword
(``additional_special_tokens`` -> ``extra_special_tokens``; the old one is swallowed by ``**kwargs``) and whose
``save_pretrained`` writes no ``special_tokens_map.json``: building the files then failed with "<|startoftext|> got id
None" (found on 2026-12-02 by the 0.19.1rc1 cell with an empty cache). The unit tests cover transformers 4.x.
Expected ids: the published gpt-oss ``tokenizer_config.json`` (written out here, not imported).
"""

import json

NAMED_SPECIALS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|channel|>": 200005,
                  "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}


def test_tokenizer_files_build_and_load_with_this_transformers(tmp_path, monkeypatch):
    import transformers
    from transformers import AutoTokenizer

    from gptoss_patch.tools import tokenizer as tk

    monkeypatch.setenv("GPTOSS_PATCH_CACHE_DIR", str(tmp_path / "cache"))  # an empty cache: built here
    written = {p.name for p in tk.write_tokenizer_files(tmp_path / "ckpt")}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= written, written
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ckpt"))
    print(f"transformers {transformers.__version__}: {sorted(written)}, {len(tok)} tokens")
    assert len(tok) == 200019
    assert {t: tok.convert_tokens_to_ids(t) for t in NAMED_SPECIALS} == NAMED_SPECIALS
    ids = tok.encode("<|start|>user<|message|>Hello<|end|>", add_special_tokens=False)
    assert ids[0] == 200006 and ids[2] == 200008 and ids[-1] == 200007 and len(ids) == 5, ids
    config = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == \
        ("<|startoftext|>", "<|return|>", "<|endoftext|>")
