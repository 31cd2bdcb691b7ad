//! The gRPC `ClientService` (cumulusctl, scripts): a thin adapter over [`crate::api`].

use std::sync::Arc;

use cumulus_api::v1;
use cumulus_api::v1::client_service_server::ClientService;
use tonic::{Request, Response, Status};

use crate::api;
use crate::auth::principal_of;
use crate::blobs;
use crate::error::to_status;
use crate::node::Node;

/// Serves the client API of one node.
pub struct ClientSvc {
    /// This coordinator's shared context; every call goes through [`crate::api`] on it.
    pub node: Arc<Node>,
}

#[tonic::async_trait]
impl ClientService for ClientSvc {
    async fn submit_job(
        &self,
        req: Request<v1::SubmitJobRequest>,
    ) -> Result<Response<v1::SubmitJobResponse>, Status> {
        let who = principal_of(&req)?;
        api::submit(&self.node, &who, req.into_inner())
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn get_job(
        &self,
        req: Request<v1::GetJobRequest>,
    ) -> Result<Response<v1::JobResponse>, Status> {
        let r = req.into_inner();
        api::get_job(&self.node, &r.job_id, r.linearizable)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn list_jobs(
        &self,
        req: Request<v1::ListJobsRequest>,
    ) -> Result<Response<v1::ListJobsResponse>, Status> {
        api::list_jobs(&self.node, req.into_inner().linearizable)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn cancel_job(
        &self,
        req: Request<v1::CancelJobRequest>,
    ) -> Result<Response<v1::JobResponse>, Status> {
        let who = principal_of(&req)?;
        api::cancel(&self.node, &who, &req.into_inner().job_id)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn pause_job(
        &self,
        req: Request<v1::PauseJobRequest>,
    ) -> Result<Response<v1::JobResponse>, Status> {
        let who = principal_of(&req)?;
        api::pause(&self.node, &who, &req.into_inner().job_id)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn resume_job(
        &self,
        req: Request<v1::ResumeJobRequest>,
    ) -> Result<Response<v1::JobResponse>, Status> {
        let who = principal_of(&req)?;
        api::resume(&self.node, &who, &req.into_inner().job_id)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn delete_job(
        &self,
        req: Request<v1::DeleteJobRequest>,
    ) -> Result<Response<v1::DeleteJobResponse>, Status> {
        let who = principal_of(&req)?;
        let req = req.into_inner();
        api::delete(&self.node, &who, &req.job_id, req.checkpoints)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn purge_jobs(
        &self,
        req: Request<v1::PurgeJobsRequest>,
    ) -> Result<Response<v1::PurgeJobsResponse>, Status> {
        let who = principal_of(&req)?;
        api::purge(&self.node, &who, req.into_inner())
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn cluster_status(
        &self,
        _req: Request<v1::ClusterStatusRequest>,
    ) -> Result<Response<v1::ClusterStatusResponse>, Status> {
        Ok(Response::new(api::cluster_status(&self.node)))
    }

    async fn list_checkpoints(
        &self,
        req: Request<v1::ListCheckpointsRequest>,
    ) -> Result<Response<v1::ListCheckpointsResponse>, Status> {
        api::list_checkpoints(&self.node, &req.into_inner().job_id)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn get_job_summary(
        &self,
        req: Request<v1::GetJobSummaryRequest>,
    ) -> Result<Response<v1::JobSummary>, Status> {
        api::job_summary(&self.node, &req.into_inner().job_id)
            .map(Response::new)
            .map_err(to_status)
    }

    async fn list_job_summaries(
        &self,
        req: Request<v1::ListJobSummariesRequest>,
    ) -> Result<Response<v1::ListJobSummariesResponse>, Status> {
        api::job_summaries(&self.node, &req.into_inner())
            .map(Response::new)
            .map_err(to_status)
    }

    async fn add_learner(
        &self,
        req: Request<v1::AddLearnerRequest>,
    ) -> Result<Response<v1::ClusterStatusResponse>, Status> {
        let who = principal_of(&req)?;
        api::add_learner(&self.node, &who, req.into_inner())
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn promote_member(
        &self,
        req: Request<v1::PromoteMemberRequest>,
    ) -> Result<Response<v1::ClusterStatusResponse>, Status> {
        let who = principal_of(&req)?;
        api::promote_member(&self.node, &who, req.into_inner().node_id)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn remove_member(
        &self,
        req: Request<v1::RemoveMemberRequest>,
    ) -> Result<Response<v1::ClusterStatusResponse>, Status> {
        let who = principal_of(&req)?;
        api::remove_member(&self.node, &who, req.into_inner().node_id)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn create_user(
        &self,
        req: Request<v1::CreateUserRequest>,
    ) -> Result<Response<v1::CreateUserResponse>, Status> {
        let who = principal_of(&req)?;
        api::create_user(&self.node, &who, req.into_inner())
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn revoke_user(
        &self,
        req: Request<v1::RevokeUserRequest>,
    ) -> Result<Response<v1::Ack>, Status> {
        let who = principal_of(&req)?;
        api::revoke_user(&self.node, &who, &req.into_inner().name)
            .await
            .map(|()| Response::new(v1::Ack {}))
            .map_err(to_status)
    }

    async fn list_users(
        &self,
        req: Request<v1::ListUsersRequest>,
    ) -> Result<Response<v1::ListUsersResponse>, Status> {
        let who = principal_of(&req)?;
        api::list_users(&self.node, &who)
            .map(Response::new)
            .map_err(to_status)
    }

    async fn who_am_i(
        &self,
        req: Request<v1::WhoAmIRequest>,
    ) -> Result<Response<v1::WhoAmIResponse>, Status> {
        let who = principal_of(&req)?;
        Ok(Response::new(v1::WhoAmIResponse {
            name: who.name,
            role: who.role.to_string(),
        }))
    }

    type GetBlobStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<v1::BlobChunk, Status>> + Send + 'static>,
    >;

    /// Whether this coordinator holds a blob: any authenticated principal.
    async fn stat_blob(
        &self,
        req: Request<v1::StatBlobRequest>,
    ) -> Result<Response<v1::StatBlobResponse>, Status> {
        let _who = principal_of(&req)?;
        api::stat_blob(&self.node, &req.into_inner().digest)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    /// An upload (the first chunk names the blob), acknowledged once a majority of the
    /// voting coordinators hold it.
    async fn put_blob(
        &self,
        req: Request<tonic::Streaming<v1::BlobChunk>>,
    ) -> Result<Response<v1::PutBlobResponse>, Status> {
        let who = principal_of(&req)?;
        let (header, chunks) = blobs::peers::from_chunks(req.into_inner()).await?;
        api::put_blob(&self.node, &who, header, chunks)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    /// A blob's bytes, verified as they stream (a corrupt copy ends the stream with
    /// DATA_LOSS and is fetched again from a peer by the next read).
    async fn get_blob(
        &self,
        req: Request<v1::GetBlobRequest>,
    ) -> Result<Response<Self::GetBlobStream>, Status> {
        let who = principal_of(&req)?;
        let digest = req.into_inner().digest;
        let read = api::get_blob(&self.node, &who, &digest)
            .await
            .map_err(to_status)?;
        let header = blobs::BlobHeader {
            digest,
            size_bytes: read.size_bytes,
        };
        Ok(Response::new(Box::pin(blobs::peers::download_chunks(
            header,
            read.chunks,
        ))))
    }
}
