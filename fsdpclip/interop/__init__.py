"""Other trainers' checkpoints: an open_clip_train checkpoint written as one of ours, ours written as a transformers
`CLIPModel`."""
