"""Write a local Hugging Face text-tower directory from parameters: config.json and a stand-in
tokenizer, no weights and no download (fsdpclip starts such a tower from random weights).

    python benchmarks/hf_tower.py examples/models/mt5-xxl --preset mt5-xxl
    python benchmarks/hf_tower.py tests/assets/t5-tiny --preset t5-tiny

The architecture is exactly the named model's (mT5-XXL: google/mt5-xxl's published config); the
tokenizer is a small word-level stand-in with T5's special tokens (pad 0, eos 1, unk 2), enough
for synthetic-data runs and tests. For real training, put the model's own tokenizer files (and
weights, with `model.text.hf.pretrained`) in the directory instead. Needs `tokenizers` (it comes
with `pip install 'fsdpclip[hf]'`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

T5_COMMON = {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "dropout_rate": 0.1,
             "layer_norm_epsilon": 1e-6, "initializer_factor": 1.0, "is_encoder_decoder": True, "pad_token_id": 0,
             "eos_token_id": 1, "decoder_start_token_id": 0}
PRESETS = {
    # google/mt5-xxl: 13B parameters with its decoder; the encoder OpenCLIP keeps has 5.66B.
    "mt5-xxl": {"model_type": "mt5", "architectures": ["MT5ForConditionalGeneration"], "d_model": 4096, "d_kv": 64,
                "d_ff": 10240, "num_layers": 24, "num_decoder_layers": 24, "num_heads": 64, "vocab_size": 250112,
                "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, **T5_COMMON},
    # A T5 small enough for 2-rank CPU tests.
    "t5-tiny": {"model_type": "t5", "architectures": ["T5Model"], "d_model": 32, "d_kv": 8, "d_ff": 64,
                "num_layers": 3, "num_decoder_layers": 1, "num_heads": 4, "vocab_size": 128,
                "feed_forward_proj": "relu", "tie_word_embeddings": True, **T5_COMMON},
}
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]
WORDS = ("a photo of the an image picture drawing digit number zero one two three four five six seven eight nine "
         "cat dog car bird plane ship truck horse deer frog small large red green blue black white").split()


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer with T5's special tokens, in the files transformers (4 or 5) loads offline."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 512}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the directory to write (created)")
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True, help="which architecture")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(PRESETS[args.preset], indent=2) + "\n")
    write_tokenizer(args.out)
    print(f"wrote {args.out}: config.json ({args.preset}) and a stand-in tokenizer")


if __name__ == "__main__":
    main()
