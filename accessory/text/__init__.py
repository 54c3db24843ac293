"""Text: tokenizers (SentencePiece or tokenizer.json) and the sandbox chat templates render in."""
