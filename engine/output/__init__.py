"""From tokens to what a caller reads.

    detokenizer.py   incremental detokenization with stop strings, never a broken UTF-8 character
    processor.py     OutputProcessor: RequestOutputs (text, n best, logprobs) from each step's tokens
"""
