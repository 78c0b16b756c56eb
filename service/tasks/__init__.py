"""The task routes, one module each: its APIRouter, its request's pre-processing (validation,
tokenization) and post-processing (answer shaping). Each runs its work in `Service.serve`."""
