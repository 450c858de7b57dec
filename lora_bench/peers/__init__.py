"""Peer implementations of the classifier, run by the same harness (loop, loss, optimizer, timer)
as the book model. ``hf``: Hugging Face transformers' GPT-2, with PEFT for LoRA. Importing this
package imports neither transformers nor peft; building a peer does."""
