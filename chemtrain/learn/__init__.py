"""Pure functions under the trainers: predictions, losses, metrics, steps."""
