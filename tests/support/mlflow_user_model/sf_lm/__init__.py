"""A user causal language model for tests/slow/test_mlflow_user_models.py, in a package
(``sf_lm.bag:build``)."""
