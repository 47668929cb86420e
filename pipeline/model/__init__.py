"""What every stage needs to know about a Hugging Face checkpoint: devices and dtypes, which
files make a model and its identity, the one model loader, compressed-tensors' own target
matching, and the one checkpoint validator (quantize's post-save check and `qship verify`)."""
