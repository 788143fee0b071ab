"""On-disk format: safetensors files with checksums, atomic publication, the manifest."""
