"""The vocabulary wing: token ids for text. vocabulary.py holds the Vocabulary interface with
seqio's id layout, bytes and SentencePiece models; tokenizer_json.py a tokenizers `tokenizer.json`
with its own ids; factory.py picks the one a DataConfig names (`make_vocabulary`)."""
