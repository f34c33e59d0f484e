"""The Hugging Face Hub: upload, verification, retries."""
