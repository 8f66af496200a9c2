"""Data, in the order it flows: `sources` (each entry of data.train_files and data.eval_files
resolved and its rows read) -> `tokenize` (rows rendered into examples with response-only labels)
-> `prepare` (tokenized once into Arrow, split, mixed and packed, opened by every rank:
`build_datasets`) -> `batching` (examples read by index, sampled and collated into tensors).
Beside them: `chat` (chat messages checked and rendered through the tokenizer's chat template),
`formats` (the constants of the data formats, `IGNORE` among them) and `packing` (placing whole
documents into rows)."""
