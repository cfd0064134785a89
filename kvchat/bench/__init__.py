"""`kvchat bench`: run.py drives the measurement, history.py builds the history it measures
after, peers.py runs the peers (transformers, llama.cpp) and report.py summarises, prints,
plots and writes JSON."""
