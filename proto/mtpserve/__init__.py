"""mtpserve protobuf packages."""
