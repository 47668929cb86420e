"""The floor every stage stands on: streaming hashes and manifests, the safetensors header
reader/writer, atomic files and folders, and the content-addressed stage cache. No model
code and no torch here."""
