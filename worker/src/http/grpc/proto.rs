//! The code generated from worker/proto/grpc_predict_v2.proto.

tonic::include_proto!("inference");
