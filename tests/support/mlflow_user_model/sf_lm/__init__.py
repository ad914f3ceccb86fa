"""A user causal language model for tests/stages/test_mlflow_model.py, in a package (``sf_lm.bag:build``)."""
