"""TRACE's value predictor as an MLflow pyfunc model: ``mlflow.pyfunc.load_model`` of a registered
``trace-predictor`` version returns the predicted success probability of each history (prompt,
or prompt plus a partial trajectory) it is given. The model's one artifact is the predictor's
saved state (``torch.save`` of ``HashedNgramPredictor.state_dict()``)."""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc


class PredictorModel(mlflow.pyfunc.PythonModel):
    """Histories (strings) in, predicted success probabilities (floats in [0, 1]) out."""

    def load_context(self, context: Any) -> None:
        import torch

        from trace_core.predictor import HashedNgramPredictor

        self.predictor = HashedNgramPredictor()
        self.predictor.load_state_dict(torch.load(context.artifacts["state"], weights_only=False))

    def predict(self, context: Any, model_input: Any, params: Any = None) -> list[float]:
        if hasattr(model_input, "iloc"):  # a DataFrame: its first column
            model_input = model_input.iloc[:, 0].tolist()
        return [float(p) for p in self.predictor.predict([str(h) for h in model_input])]
