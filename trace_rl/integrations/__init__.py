"""This project's environments under other trainers (``trl``: TRL's ``GRPOTrainer``)."""
