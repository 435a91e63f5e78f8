"""Running the model on one step's batch.

    model_runner.py     the flattened batch (ids, positions, slots, block tables), the forward pass, logits
    compiled_decode.py  --compile-decode: decode-only batches through torch.compile, one graph per bucket
"""
