"""Checkpoints that resume exactly in any layout and that a crash can never half-write
(docs/checkpoints.md):

- `index`: the format on disk (meta.json, piece keys), read and checked without torch;
- `resume`: what resuming will do, decided before any tensor file is read (the launcher's line);
- `state`: which pieces of the plain model's tensors a rank writes and reads back;
- `store`: atomic (optionally asynchronous) writing, reading pieces back;
- `hf`: Hugging Face folders in and out; `gather`: the whole model from any checkpoint;
  `command`: `ultrascale export` and `generate`.

Nothing is imported here, so that the launcher's torch-free checks can use `index` and `resume`.
"""
