//! Harvesting a server's route table from its own `/openapi.json` (placeholder).
