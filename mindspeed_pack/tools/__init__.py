"""tools stage of mindspeed-pack."""
